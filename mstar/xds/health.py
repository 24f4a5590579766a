"""Active health checks the control plane runs itself: ``GET /health`` (200) for HTTP
services, ``grpc.health.v1.Health/Check`` (SERVING) for gRPC ones."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mstar import tls as mtls
from mstar.xds.targets import Endpoint


class HealthChecker:
    def __init__(self, timeout_s: float = 1.0, tls: mtls.TLSSettings | None = None):
        """``tls``: the mesh's certificate, for ``grpc-mtls`` targets (node groups behind mutual TLS)."""
        self.timeout_s = timeout_s
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._http: aiohttp.ClientSession | None = None

    async def check_all(self, endpoints: list[Endpoint]) -> dict[Endpoint, bool]:
        live = {e.address for e in endpoints if e.health != "http"}
        for address in set(self._channels) - live:  # endpoints that went away
            await self._channels.pop(address).close()
        results = await asyncio.gather(*(self.check(e) for e in endpoints))
        return dict(zip(endpoints, results, strict=True))

    async def check(self, e: Endpoint) -> bool:
        try:
            if e.health == "http":
                return await self._check_http(e)
            return await self._check_grpc(e)
        except (TimeoutError, OSError, aiohttp.ClientError, grpc.aio.AioRpcError):
            return False

    async def _check_http(self, e: Endpoint) -> bool:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        async with self._http.get(f"http://{e.address}/health") as r:
            return r.status == 200

    async def _check_grpc(self, e: Endpoint) -> bool:
        ch = self._channels.get(e.address)
        if ch is None:
            if e.health == "grpc-mtls" and self.tls is None:
                return False  # without the mesh's certificate its handshake fails anyway
            ch = self._channels[e.address] = mtls.aio_channel(e.address, self.tls if e.health == "grpc-mtls" else None, [
                ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)])
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        if self._http is not None:
            await self._http.close()
