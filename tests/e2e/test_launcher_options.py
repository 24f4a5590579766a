"""End to end: `mstar serve` options from the original M*'s docs, on real processes."""

import base64
import glob
import json
import os
import random
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
from test_launcher import Served, http

from mstar.netif import interfaces, ipv4_of
from mstar.services.transport import mooncake

pytestmark = pytest.mark.e2e
RELAY = 1_000_000  # bytes moved from group to group: shared memory on one host


def relay(url: str) -> None:
    """Two relay requests (the first may go inline while the link learns where its peer runs)."""
    for _ in range(2):
        status, body = http("POST", f"{url}/generate", {"model": "toy", "text": "x",
                                                        "model_kwargs": {"relay_bytes": RELAY}})
        assert status == 200, body
        [chunk] = json.loads(body)["outputs"]["transfer"]["chunks"]
        assert struct.unpack("<3d", base64.b64decode(chunk["data_b64"]))[0] == RELAY


def segments(prefix: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/{prefix}*"))


def cmdline(pid: int) -> list[str]:
    return open(f"/proc/{pid}/cmdline").read().split("\0")


def multipart(fields: dict[str, str], files: dict[str, bytes]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    out = b""
    for k, v in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
    for k, data in files.items():
        out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{k}.bin"\r\n'
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@pytest.mark.timeout(300)  # two meshes start at once: ~60 s on two shared cores
def test_two_meshes_with_their_own_prefixes_serve_side_by_side(tmp_path):
    """Mesh A (`--socket-path-prefix`, `--upload-dir`, `--timeout`) and mesh B (a layout named as
    the original names it, its own prefix) run at once; each one's shared memory is its own,
    a third launch on A's prefix is refused, and stopping A leaves B's segments and B serving."""
    tag = f"mstar-t{os.getpid()}-"
    pa, pb = f"{tag}a-", f"{tag}b-"
    uploads = tmp_path / "uploads"
    a = Served("serve", "toy", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING", "--socket-path-prefix", pa,
               "--upload-dir", str(uploads), "--upload-spill-mb", "0.25", "--timeout", "30")
    b = Served("serve", "toy_two_hosts", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING",
               "--socket-path-prefix", pb)
    try:
        a.wait_ready(120)
        b.wait_ready(120)
        pids_a, pids_b = a.children(), b.children()
        assert set(pids_b) == {"front", "back", "conductor", "gateway"}  # toy_two_hosts -> two_hosts.yaml
        gw = cmdline(pids_a["gateway"])
        assert gw[gw.index("--request-timeout") + 1] == "30.0"  # --timeout reached the services
        relay(a.url)
        relay(b.url)
        seg_a, seg_b = segments(pa), segments(pb)
        assert seg_a and seg_b and not set(seg_a) & set(seg_b)
        # <prefix><owner>-<pid>-<n>: each segment belongs to a process of its own mesh
        assert {int(s.rsplit("-", 2)[1]) for s in seg_a} <= set(pids_a.values())
        assert {int(s.rsplit("-", 2)[1]) for s in seg_b} <= set(pids_b.values())

        for prefix, held in ((pa, "the same prefix"), (tag, f"the prefix '{pa}'")):
            r = subprocess.run([sys.executable, "-m", "mstar.cli", "serve", "toy", "--port", "0", "--grpc-port", "0",
                                "--socket-path-prefix", prefix], capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
            assert f"a running mesh (launcher pid {a.proc.pid}) uses {held}" in r.stderr, r.stderr[-2000:]

        # a streamed upload past --upload-spill-mb sits in A's upload dir while it runs, then goes
        big = os.urandom(600_000)
        data, ctype = multipart({"model": "toy", "text": "spill it slowly", "stream": "true",
                                 "model_kwargs": json.dumps({"delay_ms": 100})}, {"image": big})  # ~1.5 s
        req = urllib.request.Request(f"{a.url}/generate", data=data, headers={"Content-Type": ctype})
        folder = uploads / f"gateway-{pids_a['gateway']}"
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.readline())["type"] == "chunk"
            assert [p.stat().st_size for p in folder.rglob("*") if p.is_file()] == [len(big)]
            lines = [json.loads(x) for x in resp.read().decode().splitlines() if x.strip()]
        assert lines[-1]["type"] == "final"
        deadline = time.monotonic() + 5  # the client may read the last line before the handler's finally runs
        while [p for p in folder.rglob("*") if p.is_file()] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in folder.rglob("*") if p.is_file()] == []

        assert a.stop() == 0
        assert segments(pa) == [] and not folder.exists()
        assert segments(pb) == seg_b  # A's clean-up left B's segments alone
        relay(b.url)
    finally:
        a.stop()
        b.stop()
    assert segments(pa) == segments(pb) == []
    assert not os.path.exists(f"/dev/shm/.mstar-prefixes/{pa}") and not os.path.exists(f"/dev/shm/.mstar-prefixes/{pb}")


def _outward_interface() -> tuple[str, str] | None:
    for name in interfaces():
        ip = ipv4_of(name)
        if ip and not ip.startswith("127."):
            return name, ip
    return None


def _free_run(n: int) -> int:
    """The first of n consecutive ports free on every address."""
    for _ in range(200):
        first = random.randrange(20000, 30000 - n)
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no run of free ports")


def _listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.timeout(200)
def test_transfer_device_and_mooncake_ports():
    """`--tcp-transfer-device IFACE`: the node groups bind the interface's address (their links
    carry the tensors) and their Mooncake sessions name it; `--mooncake-port P`: each group's
    engine listens on its own two ports from P up."""
    where = _outward_interface()
    if where is None or not mooncake.available():
        pytest.skip("needs a network interface with a non-loopback IPv4 address and the Mooncake engine")
    name, ip = where
    first = _free_run(8)
    s = Served("serve", "toy", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING",
               "--tcp-transfer-device", name, "--mooncake-port", str(first),
               "--tls-dir", "auto")  # a non-loopback internal bind needs mutual TLS (issue 30)
    try:
        s.wait_ready(120)
        pids = s.children()
        for group in ("encoder", "decoder", "audio"):
            argv = cmdline(pids[group])
            assert argv[argv.index("--address") + 1].startswith(f"{ip}:"), argv
        conductor = cmdline(pids["conductor"])
        assert conductor[conductor.index("--address") + 1].startswith("127.0.0.1:")  # --host keeps the public ports
        relay(s.url)
        # the groups bind a non-loopback address, so each starts an engine; the conductor (127.0.0.1) does
        # not. An engine opens its listeners on its own threads: waited for (bounded), as a loaded machine
        # may be slow to
        deadline = time.monotonic() + 20
        while not set(range(first, first + 6)) <= (listening := _listening_ports()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert set(range(first, first + 6)) <= listening, sorted(p for p in listening if first <= p < first + 8)
        assert not {first + 6, first + 7} & listening
    finally:
        assert s.stop() == 0
