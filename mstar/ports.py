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
