"""Node-group replicas as the conductor sees them: who may take new requests.

A request is pinned to one replica of every node group when it is admitted (its KV
cache and other per-request state live there) and every frame of the request goes to
those replicas. New requests go to the healthy replica with the fewest requests in
flight. A replica is taken out of rotation when its stream breaks, when it fails
``probe_failures`` health checks in a row (a busy replica may miss one) or when it leaves
(drain); it comes back when a health check passes.
Replicas come from the static ``--groups`` map and from ``Join`` calls at runtime.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mstar import metrics
from mstar import tls as mtls

log = logging.getLogger(__name__)


class NoReplica(Exception):
    """No healthy replica of a node group: requests needing it are UNAVAILABLE."""


@dataclass
class Replica:
    group: str
    address: str
    healthy: bool = True
    left: bool = False  # withdrew (drain): never routed to again unless it rejoins
    inflight: int = 0
    failed_probes: int = 0  # consecutive
    last_pick: int = -1  # ties go to the replica picked least recently
    reason: str = ""  # why it is out of rotation


def parse_groups(data: dict) -> dict[str, list[str]]:
    """``{"group": "host:port" | ["host:port", ...]}`` -> lists of addresses."""
    out = {}
    for group, addrs in data.items():
        addrs = [addrs] if isinstance(addrs, str) else list(addrs)
        if not addrs or not all(isinstance(a, str) and ":" in a for a in addrs):
            raise ValueError(f"--groups: node group '{group}' needs 'host:port' addresses, got {addrs!r}")
        out[group] = addrs
    return out


class Replicas:
    def __init__(self, groups: dict[str, list[str]], probe_timeout_s: float = 2.0, probe_failures: int = 3,
                 tls: mtls.TLSSettings | None = None):
        self.tls = tls  # health checks use the mesh's mutual TLS
        self.groups = {g: {a: Replica(g, a) for a in addrs} for g, addrs in groups.items()}
        self._tie = itertools.count()
        self.probe_timeout_s = probe_timeout_s
        self.probe_failures = probe_failures  # a busy replica may miss one probe; a dead one misses them all
        self._channels: dict[str, grpc.aio.Channel] = {}
        for g in self.groups:
            self._publish(g)

    # -- membership ----------------------------------------------------------------------
    def join(self, group: str, address: str) -> None:
        if group not in self.groups:
            raise KeyError(group)
        r = self.groups[group].get(address)
        if r is None:
            r = self.groups[group][address] = Replica(group, address)
            log.info("replica %s of node group '%s' joined", address, group)
        elif r.left or not r.healthy:
            log.info("replica %s of node group '%s' rejoined", address, group)
        r.left, r.healthy, r.reason = False, True, ""
        self._publish(group)

    def leave(self, group: str, address: str) -> None:
        r = self.groups.get(group, {}).get(address)
        if r is not None and not r.left:
            r.left, r.reason = True, "left (draining)"
            log.info("replica %s of node group '%s' left", address, group)
            self._publish(group)

    def mark_down(self, group: str, address: str, reason: str) -> None:
        r = self.groups.get(group, {}).get(address)
        if r is not None and r.healthy:
            r.healthy, r.reason = False, reason
            log.warning("replica %s of node group '%s' out of rotation: %s", address, group, reason)
            self._publish(group)

    def serving(self, group: str) -> list[str]:
        return [a for a, r in self.groups.get(group, {}).items() if r.healthy and not r.left]

    # -- routing -------------------------------------------------------------------------
    def pick(self, group: str) -> str:
        live = [r for r in self.groups[group].values() if r.healthy and not r.left]
        if not live:
            why = "; ".join(f"{r.address}: {r.reason}" for r in self.groups[group].values()) or "none registered"
            raise NoReplica(f"node group '{group}' has no healthy replica ({why})")
        best = min(live, key=lambda r: (r.inflight, r.last_pick))
        best.inflight += 1
        best.last_pick = next(self._tie)
        metrics.REPLICA_ROUTED.labels(group, best.address).inc()
        return best.address

    def unpin(self, group: str, address: str) -> None:
        r = self.groups.get(group, {}).get(address)
        if r is not None and r.inflight > 0:
            r.inflight -= 1

    # -- health --------------------------------------------------------------------------
    async def probe_once(self) -> None:
        """Health-check every replica that has not left; fix up who is in rotation."""
        reps = [r for reps in self.groups.values() for r in reps.values() if not r.left]
        results = await asyncio.gather(*(self._check(r.address) for r in reps))
        for r, ok in zip(reps, results, strict=True):
            r.failed_probes = 0 if ok else r.failed_probes + 1
            if ok and not r.healthy:
                r.healthy, r.reason = True, ""
                log.info("replica %s of node group '%s' back in rotation", r.address, r.group)
                self._publish(r.group)
            elif r.failed_probes >= self.probe_failures and r.healthy:
                self.mark_down(r.group, r.address, f"failed {r.failed_probes} health checks in a row")

    async def probe_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.probe_once()

    async def _check(self, address: str) -> bool:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = mtls.aio_channel(address, self.tls)
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout_s)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self._channels.values()))

    def _publish(self, group: str) -> None:
        metrics.REPLICAS_SERVING.labels(group).set(len(self.serving(group)))
