"""``--tensor-comm-protocol RDMA`` on one host: it works where Mooncake is usable (every service
that receives tensors starts its engine at start-up and offers its session, loopback included),
and where it is not, the launcher and each service refuse at start with one line saying why,
instead of failing each request that carries a large tensor (INTERNAL: "offers no Mooncake
session")."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mstar import wire
from mstar.config import load_config
from mstar.launcher import LaunchError, LaunchOptions, Mesh
from mstar.services.transport import Protocol, configure_service, mooncake
from mstar.v1 import conductor_pb2_grpc

from helpers import collect, request, started_mesh

CONFIG = Path(__file__).resolve().parents[2] / "models" / "toy" / "configs" / "default.yaml"
NO_VERBS = "ImportError: libibverbs.so.1: cannot open shared object file: No such file or directory"
needs_mooncake = pytest.mark.skipif(not mooncake.available(),
                                    reason=f"Mooncake is not installed: {mooncake.unavailable_reason()}")


def rdma_mesh(**kw) -> Mesh:
    return Mesh(load_config(CONFIG), LaunchOptions(CONFIG, port=0, grpc_port=0, log_level="WARNING", protocol="RDMA",
                                                   startup_timeout_s=60, **kw))


def edge_tensors(metrics_url: str, **labels: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        body = r.read().decode()
    want = set(labels.items())
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
               if s.name == "mstar_edge_tensors_total" and want <= set(s.labels.items()))


@pytest.mark.e2e
@needs_mooncake
def test_forced_rdma_moves_a_large_tensor_between_groups_of_one_host():
    mesh = started_mesh(rdma_mesh)
    try:
        async def relay(n: int) -> list[float]:
            async with grpc.aio.insecure_channel(mesh.conductor_address) as ch:
                out, _ = await collect(conductor_pb2_grpc.ConductorStub(ch), request("x", relay_bytes=n), timeout=30)
            return wire.from_proto(out["transfer"][0].tensor).tolist()

        for n in (1 << 20, 3 << 20):
            size, seconds, _ = asyncio.run(asyncio.wait_for(relay(n), 40))
            assert size == n and 0 < seconds < 5
        sent = edge_tensors(mesh.metrics_urls()["encoder"], src="encoder", dst="decoder", edge="blob")
        by_mooncake = edge_tensors(mesh.metrics_urls()["encoder"], src="encoder", dst="decoder", edge="blob",
                                   transport="mooncake")
        assert sent == by_mooncake == 2  # both blobs went as Mooncake refs: no other transport stood in
    finally:
        mesh.stop()


@pytest.fixture
def no_mooncake(monkeypatch):
    """Mooncake as on a host without libibverbs: the module does not import."""
    monkeypatch.setattr(mooncake, "_import_error", lambda: NO_VERBS)
    monkeypatch.setattr(mooncake, "_engine", None)
    monkeypatch.setattr(mooncake, "_config", None)


def test_without_mooncake_forced_rdma_is_refused_at_start(no_mooncake):
    for address in ("127.0.0.1:0", "0.0.0.0:0"):  # loopback-only services too: every peer would send them refs
        with pytest.raises(ValueError, match=r"^--tensor-comm-protocol RDMA needs the Mooncake transfer engine: "
                                             r"cannot import mooncake\.engine \(ImportError: libibverbs"):
            configure_service(address, Protocol.RDMA)
    with pytest.raises(ValueError, match=r"^--tensor-comm-protocol RDMA needs the Mooncake transfer engine: .*libibverbs"):
        LaunchOptions(CONFIG, protocol="RDMA")  # the launcher, before it starts anything
    configure_service("0.0.0.0:0", Protocol.AUTO)  # AUTO needs no Mooncake: inline across hosts
    LaunchOptions(CONFIG, protocol="AUTO")
    assert mooncake._config is None and mooncake._engine is None


@needs_mooncake
def test_forced_rdma_starts_the_engine_at_start_even_on_loopback(monkeypatch):
    monkeypatch.setattr(mooncake, "_engine", None)
    monkeypatch.setattr(mooncake, "_config", None)
    configure_service("127.0.0.1:0", Protocol.RDMA)
    e = mooncake.running()
    assert e is not None and e.configured and mooncake.advertise() == (e.session, e.protocol)
    assert e.session.startswith("127.0.0.1:")


def taken_mooncake_ports() -> list[socket.socket]:
    """Two adjacent ports in Mooncake's default range (15000-17000: outside it Mooncake ignores
    MC_MIN_RPC_PORT / MC_MAX_RPC_PORT), held by listening sockets."""
    for first in range(16980, 15000, -2):
        held = []
        try:
            for port in (first, first + 1):
                s = socket.socket()
                held.append(s)
                s.bind(("0.0.0.0", port))
                s.listen()
            return held
        except OSError:
            for s in held:
                s.close()
    pytest.fail("no two free adjacent ports in 15000-17000")


@pytest.mark.e2e
@needs_mooncake
def test_a_service_whose_engine_cannot_start_refuses_with_one_line(monkeypatch, capfd):
    held = taken_mooncake_ports()
    try:
        first = held[0].getsockname()[1]
        monkeypatch.setenv("MC_MIN_RPC_PORT", str(first))  # every service's engine finds its ports taken
        monkeypatch.setenv("MC_MAX_RPC_PORT", str(first + 1))
        with pytest.raises(LaunchError, match=r"service '\w+' exited during startup with code 2"):
            rdma_mesh().start()
    finally:
        for s in held:
            s.close()
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "--tensor-comm-protocol RDMA" in line]
    assert lines and all("ERROR" in line and "Mooncake transfer engine failed to start on 127.0.0.1" in line
                         and f"{first}-{first + 1}" in line for line in lines), err
    assert len(lines) == len({line.split("]")[0] for line in lines})  # one line per service that refused
    assert "Traceback" not in err
