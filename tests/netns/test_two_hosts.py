"""Two hosts on one machine (network namespaces joined by a veth pair): the conductor and
node group 'front' on host a, node group 'back' on host b. The toy model is served across
them with inline bytes and with Mooncake over TCP; cutting the link fails the request with
an error naming the unreachable service, and requests succeed again once it is back."""

import json

import pytest

from mstar.services.transport import mooncake
from mstar.services.transport.base import MOONCAKE_MIN_BYTES

from twohosts import NetnsUnavailable, TwoHosts

pytestmark = pytest.mark.e2e

CONFIG = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "models" / "toy" / "configs" / "two_hosts.yaml")
TEXT = "Hello from host a"
ROT13 = TEXT.translate(str.maketrans("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                                     "nopqrstuvwxyzabcdefghijklmNOPQRSTUVWXYZABCDEFGHIJKLM"))
RELAY = 1 << 20  # a tensor big enough for a pooled transport


@pytest.fixture(scope="module")
def hosts():
    try:
        h = TwoHosts().create()
    except NetnsUnavailable as e:
        pytest.skip(f"two-host test needs network namespaces: {e}")
    yield h
    h.destroy()


def edge_transports(hosts, url: str) -> dict[tuple[str, str, str], float]:
    """(src, dst, transport) -> tensors, from a service's metrics (scraped inside host a/b)."""
    from prometheus_client.parser import text_string_to_metric_families

    host = "b" if hosts.ip["b"] in url else "a"
    text = hosts.tool(host, "scrape", url)["text"]
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "mstar_edge_tensors_total":
                key = (s.labels["src"], s.labels["dst"], s.labels["transport"])
                out[key] = out.get(key, 0) + s.value
    return out


def serve_and_check(hosts, protocol: str) -> dict:
    mesh = hosts.start_mesh(CONFIG, protocol)
    conductor = mesh["addresses"]["conductor"]
    try:
        r = hosts.tool("a", "generate", conductor, TEXT)
        assert r["ok"] and r["text"] == ROT13, r
        r = hosts.tool("a", "generate", conductor, "relay", json.dumps({"relay_bytes": RELAY}))
        assert r["ok"] and r["transfer"][0] == RELAY, r
        return mesh
    except BaseException:
        print(hosts.logs())
        hosts.stop_all()
        raise


def test_inline_across_hosts(hosts):
    mesh = serve_and_check(hosts, "TCP")
    try:
        front = edge_transports(hosts, mesh["metrics"]["front"])
        assert front.get(("front", "back", "inline"), 0) > 0 and not any(t != "inline" and s != d
                                                                          for s, d, t in front), front
    finally:
        hosts.stop_all()


@pytest.mark.skipif(not mooncake.available(), reason=f"Mooncake is not installed: {mooncake.unavailable_reason()}")
def test_mooncake_tcp_across_hosts(hosts):
    mesh = serve_and_check(hosts, "RDMA")  # RDMA asks for Mooncake: TCP here, no RDMA devices
    try:
        front = edge_transports(hosts, mesh["metrics"]["front"])
        assert front.get(("front", "back", "mooncake"), 0) >= 1, front  # the 1 MiB blob
        logs = hosts.logs()
        assert "protocol tcp" in logs.lower(), "the startup log says Mooncake runs over TCP"
    finally:
        hosts.stop_all()


def test_auto_picks_by_location_and_a_cut_link_fails_clearly_then_heals(hosts):
    mesh = serve_and_check(hosts, "AUTO")
    conductor = mesh["addresses"]["conductor"]
    try:
        # same host (a): shared memory for big tensors; other host: Mooncake (for tensors of
        # MOONCAKE_MIN_BYTES and more) or inline
        r = hosts.tool("a", "generate", conductor, "relay", json.dumps({"relay_bytes": MOONCAKE_MIN_BYTES}))
        assert r["ok"] and r["transfer"][0] == MOONCAKE_MIN_BYTES, r
        front = edge_transports(hosts, mesh["metrics"]["front"])
        cross = "mooncake" if mooncake.available() else "inline"
        assert front.get(("front", "back", cross), 0) >= 1, front
        logs = hosts.logs()
        assert "link front -> back: other host" in logs and "link front -> conductor: same host" in logs, logs

        hosts.link(False)
        r = hosts.tool("a", "generate", conductor, "cut", "{}", "30")
        assert not r["ok"] and r["code"] == "UNAVAILABLE", r
        assert "back" in r["details"] and hosts.ip["b"] in r["details"], r["details"]
        assert r["seconds"] < 15, "the cut is noticed by keepalive / health checks, not by a request timeout"

        hosts.link(True)
        import time

        deadline = time.monotonic() + 20
        while True:  # the conductor's health probe puts 'back' back in rotation within seconds
            r = hosts.tool("a", "generate", conductor, TEXT, "{}", "20")
            if r["ok"] or time.monotonic() > deadline:
                break
            assert r["code"] == "UNAVAILABLE", r
            time.sleep(0.5)
        assert r["ok"] and r["text"] == ROT13, r
    except BaseException:
        print(hosts.logs())
        raise
    finally:
        hosts.stop_all()
