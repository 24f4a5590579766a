"""What the control plane watches: service targets from JSON files, resolved to endpoints.

A targets path is one JSON file or a directory of ``*.json`` files, each holding a list of
``{"cluster": "gateway", "address": "host:port", "health": "http" | "grpc" | "grpc-mtls"}`` (``grpc-mtls``:
the mesh's internal ports, checked with the control plane's ``--tls-dir`` certificate). Files are
re-read whenever they change, so a service registers by adding a file (or a line) and
deregisters by removing it. A host name resolves to every address it has (a compose service
scaled to N replicas, a Kubernetes headless Service), each health-checked on its own.

Cluster names the routes use: ``gateway`` (REST) and ``conductor`` (gRPC); any other
cluster (``node-<group>``) is published for Envoy's health view and stats only.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from pathlib import Path

HEALTH_KINDS = ("http", "grpc", "grpc-mtls")


class TargetsError(ValueError):
    pass


@dataclass(frozen=True, order=True)
class Target:
    cluster: str
    host: str
    port: int
    health: str  # "http": GET /health answers 200; "grpc" / "grpc-mtls": grpc.health.v1 reports SERVING


@dataclass(frozen=True, order=True)
class Endpoint:
    cluster: str
    ip: str
    port: int
    health: str

    @property
    def address(self) -> str:
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


def parse_targets(data, source: str) -> list[Target]:
    if not isinstance(data, list):
        raise TargetsError(f"{source}: expected a JSON list of {{cluster, address, health}} objects")
    out = []
    for i, t in enumerate(data):
        where = f"{source}[{i}]"
        if not isinstance(t, dict) or set(t) - {"cluster", "address", "health"}:
            raise TargetsError(f"{where}: expected an object with keys cluster, address, health")
        cluster, address, health = t.get("cluster"), t.get("address"), t.get("health", "grpc")
        if not isinstance(cluster, str) or not cluster.replace("-", "").replace("_", "").isalnum():
            raise TargetsError(f"{where}: cluster must be letters, digits, '-' or '_', got {cluster!r}")
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit():
            raise TargetsError(f"{where}: address must be host:port, got {address!r}")
        if health not in HEALTH_KINDS:
            raise TargetsError(f"{where}: health must be one of {', '.join(HEALTH_KINDS)}, got {health!r}")
        out.append(Target(cluster, host.strip("[]"), int(port), health))
    return out


class TargetSource:
    """Targets under ``path``, re-read only when a file's mtime or the file set changes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._stamp: tuple | None = None
        self._targets: list[Target] = []

    def _files(self) -> list[Path]:
        if self.path.is_dir():
            return sorted(self.path.glob("*.json"))
        return [self.path] if self.path.exists() else []

    @property
    def last(self) -> list[Target]:
        """The targets of the last successful read."""
        return self._targets

    def read(self) -> list[Target]:
        files = self._files()
        stamp = tuple((str(f), f.stat().st_mtime_ns) for f in files)
        if stamp != self._stamp:
            targets: list[Target] = []
            for f in files:
                try:
                    targets += parse_targets(json.loads(f.read_text() or "[]"), str(f))
                except json.JSONDecodeError as e:
                    raise TargetsError(f"{f}: not valid JSON: {e}") from None
            self._targets, self._stamp = sorted(set(targets)), stamp
        return self._targets


async def resolve(targets: list[Target]) -> list[Endpoint]:
    """Every address of every target; a name that does not resolve (yet) gives none."""
    loop = asyncio.get_running_loop()

    async def one(t: Target) -> list[Endpoint]:
        try:
            infos = await loop.getaddrinfo(t.host, t.port, type=socket.SOCK_STREAM)
        except OSError:
            return []
        return [Endpoint(t.cluster, str(info[4][0]), t.port, t.health) for info in infos]  # an IP string

    found = await asyncio.gather(*(one(t) for t in targets))
    return sorted({e for eps in found for e in eps})
