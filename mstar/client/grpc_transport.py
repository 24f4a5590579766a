"""gRPC transports (sync and asyncio): the SDK talking to the conductor directly."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mstar.client.convert import (
    Message,
    act_to_proto,
    message_from_proto,
    model_from_proto,
    tensor_from_proto,
    to_proto,
)
from mstar.client.errors import MStarError, from_grpc
from mstar.client.robot import ActParams
from mstar.client.types import GenerateParams, Health, ModelInfo, Tensor
from mstar.limits import REQUEST_CHANNEL_OPTIONS
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

CHANNEL_OPTIONS = REQUEST_CHANNEL_OPTIONS  # mstar/limits.py: what the conductor's public API reads
_SERVING = health_pb2.HealthCheckResponse.SERVING


def _status_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


class GrpcCall:
    """One Generate stream; ``next()`` returns None after the last message."""

    def __init__(self, call):
        self._call = call
        self._it = iter(call)

    def next(self) -> Message | None:
        try:
            return message_from_proto(next(self._it))
        except StopIteration:
            return None
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    def cancel(self) -> None:
        self._call.cancel()

    def finish(self) -> None:
        """After the final event: the call ends with OK on its own."""


def _auth(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the API key (the conductor reads ``authorization: Bearer <key>``)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class GrpcTransport:
    def __init__(self, target: str, secure: bool, api_key: str | None = None):
        creds = grpc.ssl_channel_credentials() if secure else None
        self.target = target
        self._md = _auth(api_key)
        self._channel = (grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS) if creds
                         else grpc.insecure_channel(target, options=CHANNEL_OPTIONS))
        self._stub = conductor_pb2_grpc.ConductorStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, params: GenerateParams, timeout: float) -> GrpcCall:
        return GrpcCall(self._stub.Generate(to_proto(params), timeout=timeout, metadata=self._md))

    def act(self, params: ActParams, timeout: float) -> Tensor:
        try:
            resp = self._stub.Act(act_to_proto(params), timeout=timeout, metadata=self._md)
        except grpc.RpcError as e:
            raise from_grpc(e) from None
        return tensor_from_proto(resp.actions)

    def models(self, timeout: float) -> list[ModelInfo]:
        try:
            resp = self._stub.ListModels(cpb.ListModelsRequest(), timeout=timeout, metadata=self._md)
        except grpc.RpcError as e:
            raise from_grpc(e) from None
        return [model_from_proto(m) for m in resp.models]

    def health(self, timeout: float) -> Health:
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as e:
            err: MStarError = from_grpc(e)
            return Health(False, "unreachable", f"conductor at {self.target}: {err.code}: {err.message}")
        if resp.status != _SERVING:
            return Health(False, "unavailable", f"conductor at {self.target} reports {_status_name(resp.status)}")
        return Health(True, "ok")

    def close(self) -> None:
        self._channel.close()


class AsyncGrpcCall:
    def __init__(self, call: grpc.aio.UnaryStreamCall):
        self._call = call

    async def next(self) -> Message | None:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return None if msg is grpc.aio.EOF else message_from_proto(msg)

    def cancel(self) -> None:
        self._call.cancel()

    async def finish(self) -> None:
        """After the final event: the call ends with OK on its own."""


class AsyncGrpcTransport:
    """The channel opens on first use, inside the caller's event loop."""

    def __init__(self, target: str, secure: bool, api_key: str | None = None):
        self.target, self._secure = target, secure
        self._md = _auth(api_key)
        self._channel: grpc.aio.Channel | None = None

    def _stubs(self) -> tuple[conductor_pb2_grpc.ConductorStub, health_pb2_grpc.HealthStub]:
        if self._channel is None:
            self._channel = (grpc.aio.secure_channel(self.target, grpc.ssl_channel_credentials(), options=CHANNEL_OPTIONS)
                             if self._secure else grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS))
        return conductor_pb2_grpc.ConductorStub(self._channel), health_pb2_grpc.HealthStub(self._channel)

    async def generate(self, params: GenerateParams, timeout: float) -> AsyncGrpcCall:
        return AsyncGrpcCall(self._stubs()[0].Generate(to_proto(params), timeout=timeout, metadata=self._md))

    async def act(self, params: ActParams, timeout: float) -> Tensor:
        try:
            resp = await self._stubs()[0].Act(act_to_proto(params), timeout=timeout, metadata=self._md)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return tensor_from_proto(resp.actions)

    async def models(self, timeout: float) -> list[ModelInfo]:
        try:
            resp = await self._stubs()[0].ListModels(cpb.ListModelsRequest(), timeout=timeout, metadata=self._md)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return [model_from_proto(m) for m in resp.models]

    async def health(self, timeout: float) -> Health:
        try:
            resp = await self._stubs()[1].Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            err = from_grpc(e)
            return Health(False, "unreachable", f"conductor at {self.target}: {err.code}: {err.message}")
        if resp.status != _SERVING:
            return Health(False, "unavailable", f"conductor at {self.target} reports {_status_name(resp.status)}")
        return Health(True, "ok")

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
