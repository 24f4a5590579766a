"""A tensor-parallel node group (Orpheus's LLM over two CPU ranks, gloo) opens nothing beyond
loopback: its ranks meet in a private file store and their collectives bind loopback, so no
socket of theirs listens on another address; the store's directory is gone once the group
stops, whether it stopped cleanly or because a rank died."""

import ipaddress
import os
import signal
import socket
import stat
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest

from mstar.config import load_config
from mstar.launcher import LaunchOptions, Mesh
from mstar.netif import interfaces, ipv4_of

from helpers import started_mesh

CONFIG = "models/orpheus/configs/tp2.yaml"
pytestmark = pytest.mark.e2e


def follower_pids(pid: int) -> list[int]:
    kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [int(k) for k in kids if "--tp-rank" in open(f"/proc/{k}/cmdline").read().split("\0")]


def rendezvous_dir(follower: int) -> Path:
    """The directory of the file store rank 1 was told to meet rank 0 in (its --tp-init)."""
    argv = open(f"/proc/{follower}/cmdline").read().split("\0")
    init = urlparse(argv[argv.index("--tp-init") + 1])
    assert init.scheme == "file", f"the ranks meet at {init.geturl()}, not in a file store"
    return Path(init.path).parent


def start(weights) -> tuple[Mesh, subprocess.Popen, int]:
    """The tp2 mesh, its 'llm' service and that service's rank 1."""
    mesh = started_mesh(lambda: Mesh(load_config(CONFIG), LaunchOptions(
        Path(CONFIG), port=0, grpc_port=0, cache_dir=weights, log_level="WARNING", startup_timeout_s=120)))
    try:
        llm = next(s for s in mesh.services if s.name == "llm")
        (follower,) = follower_pids(llm.proc.pid)
    except BaseException:
        mesh.stop()
        raise
    return mesh, llm.proc, follower


def listening(pids: list[int]) -> dict[int, list[str]]:
    """The addresses each process's TCP sockets LISTEN on, from /proc/net/tcp{,6} (socket inodes
    mapped through /proc/<pid>/fd)."""
    owner: dict[str, int] = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                owner[target[len("socket:["):-1]] = pid
    out: dict[int, list[str]] = {pid: [] for pid in pids}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in owner:  # TCP_LISTEN
                out[owner[inode]].append(_address(local, family))
    return out


def _address(hex_addr: str, family: int) -> str:
    """'0100007F:1F90' (/proc/net/tcp: 32-bit words in host order, port big-endian) as 'ip:port'."""
    raw, port = hex_addr.split(":")
    packed = b"".join(int(raw[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(raw), 8))
    return f"{socket.inet_ntop(family, packed)}:{int(port, 16)}"


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_address_parsing():
    assert _address("0100007F:1F90", socket.AF_INET) == "127.0.0.1:8080"
    assert _address("00000000:0050", socket.AF_INET) == "0.0.0.0:80"
    assert _address("00000000000000000000000000000000:674B", socket.AF_INET6) == ":::26443"
    mapped = _address("0000000000000000FFFF00000100007F:911B", socket.AF_INET6)
    assert mapped == "::ffff:127.0.0.1:37147" and is_loopback(mapped)
    assert _address("00000000000000000000000001000000:0016", socket.AF_INET6) == "::1:22"
    assert not is_loopback(":::26443") and not is_loopback("0.0.0.0:80") and not is_loopback("192.0.2.2:5")


@pytest.fixture
def lan_gloo(monkeypatch):
    """GLOO_SOCKET_IFNAME naming a non-loopback interface of this host when it has one, as a host
    whose name resolves to its LAN address would make gloo choose: the ranks must still bind
    loopback."""
    lan = next((i for i in interfaces() if i != "lo" and ipv4_of(i)), None)
    if lan is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", lan)
    return lan


def test_tp_ranks_listen_on_loopback_only_and_leave_no_rendezvous(weights, lan_gloo):
    mesh, llm, follower = start(weights)
    try:
        listens = listening([llm.pid, follower])
        assert listens[follower], "rank 1 listens on nothing: the gloo group did not form"
        outside = {pid: [a for a in addrs if not is_loopback(a)] for pid, addrs in listens.items()}
        assert not any(outside.values()), f"tensor-parallel ranks listen beyond loopback: {outside}"

        rendezvous = rendezvous_dir(follower)
        assert stat.S_IMODE(rendezvous.stat().st_mode) == 0o700 and rendezvous.stat().st_uid == os.getuid()

        llm.send_signal(signal.SIGTERM)  # a clean stop: rank 0 releases rank 1, then exits
        assert llm.wait(30) == 0
        assert not rendezvous.exists()
    finally:
        mesh.stop()


def test_a_dead_rank_takes_the_rendezvous_with_its_service(weights):
    mesh, llm, follower = start(weights)
    try:
        rendezvous = rendezvous_dir(follower)
        assert rendezvous.is_dir()
        os.kill(follower, signal.SIGKILL)
        assert llm.wait(15) == 1  # the service leaves on the failure (os._exit)...
        assert not rendezvous.exists()  # ...without leaving its rendezvous behind
    finally:
        mesh.stop()
