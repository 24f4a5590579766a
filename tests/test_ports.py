"""Ports the launcher picks for services that bind them later."""

import socket
from pathlib import Path

from mstar.ports import free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port("127.0.0.1") for _ in range(20)]
    assert len(set(ports)) == 20 and all(1024 <= p < low for p in ports)
    with socket.socket() as s:  # nothing holds it: a service can bind it
        s.bind(("127.0.0.1", ports[0]))
