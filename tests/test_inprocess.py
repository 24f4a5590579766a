"""The in-process test mesh picks its ports before binding them: one taken in between (another test
process on the machine) is retried with fresh ports, and a port that stays taken fails naming it."""

import socket

import pytest
from test_engine_node import CFG, req

import inprocess
from helpers import collect, run


def test_a_port_taken_before_bind_is_retried_with_fresh_ones(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        real, calls = inprocess.free_port, []

        def first_taken(host):
            calls.append(host)
            return port if len(calls) == 1 else real(host)

        monkeypatch.setattr(inprocess, "free_port", first_taken)

        async def go():
            async with inprocess.inprocess_mesh(CFG) as mesh:
                assert all(not a.endswith(f":{port}") for a in (mesh.address, mesh.internal))
                out, _ = await collect(mesh.stub, req(2, n=3), timeout=30)
                return len(out["tok"])
        assert run(go(), timeout=60) == 3
        assert len(calls) > 3  # a second set of ports was chosen


def test_a_port_that_stays_taken_fails_naming_it(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(inprocess, "free_port", lambda host: port)

        async def go():
            async with inprocess.inprocess_mesh(CFG):
                pass
        with pytest.raises(inprocess.PortInUse, match=f"127.0.0.1:{port}"):
            run(go(), timeout=60)
