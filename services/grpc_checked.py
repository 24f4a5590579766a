"""Registering a servicer so that a request that cannot be read gets a status that says so.

grpc answers a message its deserializer cannot parse with UNKNOWN ("Unexpected DecodeError"):
to the client that is a server fault. Here every method's deserializer returns a ``Refused``
marker instead of raising, and the method answers it with INVALID_ARGUMENT (bytes that are not
the request message) or RESOURCE_EXHAUSTED (more bytes than ``max_request_bytes``, the public
API's message limit: a request is refused before it is parsed). Behaviours that get a readable
message run as before (a streamed response passes through one more async generator).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Refused:
    """A request message that was not parsed, and why."""

    code: grpc.StatusCode
    message: str


def _checked_deserializer(parse: Callable[[bytes], object], what: str, max_bytes: int | None):
    def deserialize(raw: bytes) -> object:
        if max_bytes is not None and len(raw) > max_bytes:
            return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the {what} message is {len(raw)} bytes; this server "
                                                               f"takes at most {max_bytes} ({max_bytes / 2**20:g} MiB)")
        try:
            return parse(raw)
        except (DecodeError, ValueError, RuntimeError) as e:  # upb raises DecodeError; be lenient on the type
            return Refused(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {what} message: {e}")
    return deserialize


async def _checked_iterator(requests, context):
    async for msg in requests:
        if isinstance(msg, Refused):
            await context.abort(msg.code, msg.message)
        yield msg


async def _relay(responses):
    """Yield what the behaviour's async generator yields; closed with it however the call ends."""
    try:
        async for r in responses:
            yield r
    finally:
        await responses.aclose()


def _wrap(handler: grpc.RpcMethodHandler, what: str, max_bytes: int | None) -> grpc.RpcMethodHandler:
    """grpc.aio runs a behaviour by its kind (coroutine or async generator function): the wrappers
    are of the same kind as the M* servicers' methods they wrap."""
    deserializer = _checked_deserializer(handler.request_deserializer, what, max_bytes)
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, Refused):
                await context.abort(request.code, request.message)
            return await inner_uu(request, context)
        return handler._replace(request_deserializer=deserializer, unary_unary=unary_unary)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, Refused):
                await context.abort(request.code, request.message)
            async for r in _relay(inner_us(request, context)):
                yield r
        return handler._replace(request_deserializer=deserializer, unary_stream=unary_stream)
    if handler.stream_stream is not None:
        inner_ss = handler.stream_stream

        async def stream_stream(requests, context):
            async for r in _relay(inner_ss(_checked_iterator(requests, context), context)):
                yield r
        return handler._replace(request_deserializer=deserializer, stream_stream=stream_stream)
    inner_su = handler.stream_unary

    async def stream_unary(requests, context):
        return await inner_su(_checked_iterator(requests, context), context)
    return handler._replace(request_deserializer=deserializer, stream_unary=stream_unary)


class _Capture:
    """Stands in for the server in a generated ``add_XServicer_to_server``: keeps its handlers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        """Built from the same handlers as the registered ones below: made again from those."""

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.services[service] = handlers


def add_checked(add_to_server: Callable, servicer: object, server: grpc.aio.Server,
                max_request_bytes: int | None = None) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_XServicer_to_server``) with every
    method's request read as untrusted input (module docstring)."""
    capture = _Capture()
    add_to_server(servicer, capture)
    for service, handlers in capture.services.items():
        checked = {name: _wrap(h, f"{service}/{name} request", max_request_bytes) for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, checked),))
        server.add_registered_method_handlers(service, checked)
