"""The gateway's one long-lived gRPC channel to the conductor. Every call carries a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mstar.gateway.auth import CALLER_METADATA
from mstar.limits import REQUEST_CHANNEL_OPTIONS
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

CHANNEL_OPTIONS = [
    *REQUEST_CHANNEL_OPTIONS,  # mstar/limits.py: what the conductor's public API reads
    # A restarted conductor is found again within seconds, not after gRPC's default 120 s backoff.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


def _build_and_serialize(build: Callable[[], cpb.GenerateRequest]) -> bytes:
    return build().SerializeToString()


class ConductorClient:
    def __init__(self, address: str, *, health_timeout_s: float = 1.0, list_timeout_s: float = 5.0,
                 models_ttl_s: float = 5.0, models_min_refresh_s: float = 1.0):
        self.address = address
        self.health_timeout_s, self.list_timeout_s = health_timeout_s, list_timeout_s
        self.models_ttl_s, self.models_min_refresh_s = models_ttl_s, models_min_refresh_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: conductor_pb2_grpc.ConductorStub | None = None
        self._generate_built: grpc.aio.UnaryStreamMultiCallable | None = None  # Generate, request built at send
        self._health: health_pb2_grpc.HealthStub | None = None
        self._models: dict[str, cpb.ModelInfo] = {}
        self._models_at = -float("inf")  # time.monotonic() of the last ListModels answer
        self._models_lock = asyncio.Lock()

    async def open(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = conductor_pb2_grpc.ConductorStub(self._channel)
        self._generate_built = self._channel.unary_stream(
            "/mstar.v1.Conductor/Generate", request_serializer=_build_and_serialize,
            response_deserializer=cpb.GenerateResponse.FromString)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self, grace_s: float | None = None) -> None:
        if self._channel is not None:
            await self._channel.close(grace_s)
            self._channel = None

    @property
    def stub(self) -> conductor_pb2_grpc.ConductorStub:
        if self._stub is None:
            raise RuntimeError("ConductorClient is not open (the app has not started)")
        return self._stub

    def generate(self, request: cpb.GenerateRequest | Callable[[], cpb.GenerateRequest],
                 deadline_s: float) -> grpc.aio.UnaryStreamCall:
        """``request`` may be a function building it: gRPC calls it as it sends the request, and the
        call keeps only the function, not the message (whose files may be large)."""
        if callable(request):
            assert self._generate_built is not None, "ConductorClient is not open"
            return self._generate_built(request, timeout=deadline_s, metadata=CALLER_METADATA.get())
        return self.stub.Generate(request, timeout=deadline_s, metadata=CALLER_METADATA.get())

    async def health_problem(self) -> str | None:
        """None when the conductor reports SERVING, else why not."""
        assert self._health is not None, "ConductorClient is not open"
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.health_timeout_s)
        except grpc.aio.AioRpcError as e:
            return f"conductor at {self.address} is unreachable: {e.code().name}: {e.details()}"
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return f"conductor at {self.address} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
        return None

    async def models(self, *, max_age_s: float | None = None) -> dict[str, cpb.ModelInfo]:
        """The served models by name, from ListModels; answers at most ``max_age_s`` old are reused
        (default: the cache TTL). Raises grpc.aio.AioRpcError when the conductor cannot answer."""
        max_age_s = self.models_ttl_s if max_age_s is None else max_age_s
        async with self._models_lock:  # concurrent misses share one ListModels call
            if time.monotonic() - self._models_at > max_age_s:
                resp = await self.stub.ListModels(cpb.ListModelsRequest(), timeout=self.list_timeout_s,
                                                  metadata=CALLER_METADATA.get())
                self._models = {m.name: m for m in resp.models}
                self._models_at = time.monotonic()
            return self._models

    async def find_model(self, name: str) -> tuple[cpb.ModelInfo | None, list[str]]:
        """The model's info (None if not served) and the names served. A miss re-asks the
        conductor (at most once per ``models_min_refresh_s``) in case the cache is stale."""
        models = await self.models()
        if name not in models:
            models = await self.models(max_age_s=self.models_min_refresh_s)
        return models.get(name), sorted(models)
