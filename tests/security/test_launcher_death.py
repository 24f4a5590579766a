"""Issue 30, finding 10: a SIGKILLed launcher left its services running under PID 1, holding
their ports and shared memory. Now each service gets SIGTERM when the launcher dies
(PR_SET_PDEATHSIG, mstar/lifetime.py) and stops cleanly, unlinking its segments.
Issue 49, hole 3: ``--tls-dir auto`` left the mesh's CA key and a service key in the temporary
folder after a SIGKILL; now no key is ever written (the launcher hands it over through pipes)."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import sys
import time
import urllib.request

import pytest
from security_mesh import start_mesh

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")]
GONE_WITHIN_S = 10.0


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet has exited: it holds no port or mapping)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def port_free(port: int) -> bool:
    """As a server binds it (mstar/ports.py): SO_REUSEADDR, so TIME_WAIT leftovers do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def private_keys(folder) -> list[str]:
    """Files under ``folder`` that hold a PEM private key."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    if b"PRIVATE KEY-----" in f.read():
                        found.append(path)
            except OSError:
                pass
    return found


@pytest.mark.timeout(120)
def test_services_die_with_a_sigkilled_launcher(tmp_path):
    tmp = tmp_path / "tmp"  # the mesh's temporary folder (TMPDIR): where --tls-dir auto once wrote its keys
    tmp.mkdir()
    mesh = start_mesh("--tensor-comm-protocol", "SHM", "--tls-dir", "auto", env={"TMPDIR": str(tmp)})
    try:
        assert private_keys(tmp) == [], "the mesh's keys stay in memory"
        services = children(mesh.proc.pid)
        assert len(services) >= 5, services  # 3 node groups, the conductor, the gateway
        # a tensor between two groups through shared memory: the mesh holds segments now
        body = json.dumps({"model": "toy", "text": "x", "model_kwargs": {"relay_bytes": 1 << 20}}).encode()
        req = urllib.request.Request(f"{mesh.url}/generate", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=20) as r:
            assert r.status == 200
        assert glob.glob(f"/dev/shm/{mesh.prefix}*"), "the relay made no shared-memory segment"
        ports = [int(mesh.url.rsplit(":", 1)[1]), int(mesh.grpc.rsplit(":", 1)[1])]

        mesh.proc.send_signal(signal.SIGKILL)
        mesh.proc.wait(10)
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(alive(p) for p in services) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in services if alive(p)], "services outlived their launcher"
        assert all(port_free(p) for p in ports), ports
        assert glob.glob(f"/dev/shm/{mesh.prefix}*") == []
        assert private_keys(tmp) == [], "no key is left behind"
    finally:
        for p in children(mesh.proc.pid) if mesh.proc.poll() is None else []:
            os.kill(p, signal.SIGKILL)
        if mesh.proc.poll() is None:
            mesh.proc.kill()
        for path in glob.glob(f"/dev/shm/{mesh.prefix}*"):
            os.unlink(path)
