"""Ports chosen now and bound later by another process."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_TAKEN_PORTS: set[int] = set()


def free_port(host: str) -> int:
    """A port bindable on ``host`` now, from just below the kernel's ephemeral range. Ports are
    chosen before the services that bind them start; one from the ephemeral range could
    meanwhile become the local port of any outgoing connection or port-0 socket, and the
    service would fail with "address already in use"."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - 10000)
    for _ in range(500):
        port = random.randrange(first, low)
        if port in _TAKEN_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _TAKEN_PORTS.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in [{first}, {low})")


#: a service's exit code when a port it must listen on is held by another socket (Linux's
#: EADDRINUSE): the launcher then knows a port it chose was taken meanwhile (``mstar.launcher``)
EXIT_PORT_IN_USE = 98


class PortInUse(OSError):
    """A port a service must listen on is held by another socket; the message names it and
    says what to change."""


def taken_ports(host: str, ports: dict[str, int]) -> list[str]:
    """The entries of ``ports`` (what binds it -> port; 0 = any free port, skipped) that cannot
    be bound on ``host`` now, each as "what (host:port): why". The probe socket sets
    SO_REUSEADDR as every server here does (grpc, aiohttp), so a port left in TIME_WAIT by a
    mesh that just stopped is free, and a port another process listens on is taken whether or
    not that process set SO_REUSEPORT."""
    taken = []
    for what, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                taken.append(f"{what} ({host}:{port}): {e.strerror or e}")
    return taken
