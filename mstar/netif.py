"""Network interfaces by name (``--tcp-transfer-device eth0``): their IPv4 address, checked
before anything starts."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


class InterfaceError(ValueError):
    """The interface or address cannot carry the mesh's tensors; the message says what to pass."""


def interfaces() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


def ipv4_of(name: str) -> str | None:
    """The interface's (first) IPv4 address; None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def _bindable(address: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
            return True
        except OSError:
            return False


def transfer_address(device: str, flag: str = "--tcp-transfer-device") -> str:
    """The address services bind to carry tensors over ``device``: an interface name (its IPv4
    address) or an IP address of this host."""
    try:
        ip = ipaddress.ip_address(device)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.version != 4:
            raise InterfaceError(f"{flag} {device}: the launcher places services on IPv4 addresses; pass an IPv4 "
                                 f"address or an interface ({', '.join(interfaces())})")
        if not _bindable(str(ip)):
            raise InterfaceError(f"{flag} {device}: not an address of this host; pass one of its interfaces "
                                 f"({', '.join(interfaces())}) or an address one of them has")
        return str(ip)
    if device not in interfaces():
        raise InterfaceError(f"{flag} {device}: no network interface named '{device}' on this host; "
                             f"its interfaces: {', '.join(interfaces())}")
    address = ipv4_of(device)
    if address is None:
        raise InterfaceError(f"{flag} {device}: the interface has no IPv4 address; give it one, or pass another "
                             f"interface ({', '.join(interfaces())}) or an IP address")
    return address
