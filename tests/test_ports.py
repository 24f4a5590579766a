"""Ports the launcher picks for services that bind them later."""

import socket
from pathlib import Path

from mstar.ports import EXIT_PORT_IN_USE, free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port("127.0.0.1") for _ in range(20)]
    assert len(set(ports)) == 20 and all(1024 <= p < low for p in ports)
    with socket.socket() as s:  # nothing holds it: a service can bind it
        s.bind(("127.0.0.1", ports[0]))


def test_taken_ports_names_each_held_port_and_skips_port_0():
    from mstar.ports import taken_ports

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        held = busy.getsockname()[1]
        free = free_port("127.0.0.1")
        taken = taken_ports("127.0.0.1", {"conductor (--grpc-port)": held, "gateway (--port)": free, "any": 0})
    assert taken == [f"conductor (--grpc-port) (127.0.0.1:{held}): Address already in use"]


def test_grpc_servers_refuse_to_share_a_port():
    """grpc sets SO_REUSEPORT by default: without ServerBase's option a second server binds a
    port the first listens on, and the kernel splits connections between them."""
    import asyncio

    import pytest

    from mstar.ports import PortInUse
    from mstar.services.grpc_server import ServerBase

    async def go():
        first = ServerBase("127.0.0.1:0", [])
        await first.server.start()
        try:
            with pytest.raises(PortInUse, match=f"cannot listen on 127.0.0.1:{first.port}: the port is in use"):
                ServerBase(f"127.0.0.1:{first.port}", [])
        finally:
            await first.server.stop(None)

    asyncio.run(go())


def test_a_service_on_a_taken_port_exits_with_one_line(tmp_path):
    """`python -m mstar.conductor` on a held port: exit code EXIT_PORT_IN_USE (the launcher reads it)
    and a log line naming the address, no traceback."""
    import json
    import subprocess
    import sys

    config = Path(__file__).resolve().parent.parent / "models" / "toy" / "configs" / "default.yaml"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        groups = {g: f"127.0.0.1:{free_port('127.0.0.1')}" for g in ("encoder", "decoder", "audio")}
        r = subprocess.run([sys.executable, "-m", "mstar.conductor", "--config", str(config), "--address",
                            f"127.0.0.1:{port}", "--groups", json.dumps(groups), "--insecure-internal"], capture_output=True, text=True,
                           timeout=60)
    assert r.returncode == EXIT_PORT_IN_USE == 98, r.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in r.stderr and "Traceback" not in r.stderr


def test_metrics_on_a_taken_port_is_port_in_use():
    import pytest

    from mstar.metrics import serve_metrics
    from mstar.ports import PortInUse

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortInUse, match=f"cannot serve metrics on 127.0.0.1:{port}: the port is in use"):
            serve_metrics("127.0.0.1:1", port)

