"""``POST /generate``: one Conductor.Generate call, answered as NDJSON (stream) or one JSON object,
or in binary when the ``Accept`` header asks (binary.py: one tensor's raw bytes, or multipart parts).

Errors before the first conductor message become an HTTP status (the headers wait for that
message). Errors after streaming began become a last ``{"type": "error"}`` line. Whatever
ends the handler (success, error, client disconnect, shutdown) cancels the gRPC call if it
is still running, so the conductor releases the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import grpc
from aiohttp import hdrs, web

from mstar.gateway.binary import MULTIPART, OCTET, accepted, check_output, multipart_stream, octet_response
from mstar.gateway.body import read_generate_body
from mstar.gateway.client import ConductorClient
from mstar.gateway.convert import Collected, ProtocolError, error_json, message_lines, to_request
from mstar.gateway.errors import ApiError, bad_request
from mstar.gateway.uploads import RequestFiles, UploadDir
from mstar.v1 import conductor_pb2 as cpb

log = logging.getLogger("mstar.gateway")

#: The gRPC deadline exceeds the request's timeout by this much, so that the conductor's own
#: DEADLINE_EXCEEDED (which says which limit was hit) normally arrives first.
DEADLINE_SLACK_S = 2.0
NDJSON = "application/x-ndjson"
SETTLE_S = 1.0


@dataclass(frozen=True)
class GatewaySettings:
    conductor_address: str
    #: largest accepted request body, bytes (JSON or multipart with files)
    max_upload_bytes: int
    #: longest a request may run, seconds; also the largest timeout_s a client may ask for
    request_timeout_s: float

    def __post_init__(self):
        if self.max_upload_bytes <= 0:
            raise ValueError(f"max_upload_bytes must be > 0, got {self.max_upload_bytes}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


SETTINGS = web.AppKey("settings", GatewaySettings)
CLIENT = web.AppKey("client", ConductorClient)
#: where large uploads spill (absent: they stay in memory); uploads.py
UPLOADS = web.AppKey("uploads", UploadDir)


async def generate(request: web.Request) -> web.StreamResponse:
    spill = request.app[UPLOADS].request() if UPLOADS in request.app else None
    try:
        return await _generate(request, spill)
    finally:  # every way a request ends, a client gone (the handler cancelled) included
        if spill is not None:
            spill.remove()


async def _generate(request: web.Request, spill: RequestFiles | None) -> web.StreamResponse:
    settings, client = request.app[SETTINGS], request.app[CLIENT]
    body = await read_generate_body(request, settings.max_upload_bytes, settings.request_timeout_s, spill)
    info, served = await client.find_model(body.model)
    if info is None:
        raise ApiError(404, f"model: unknown model '{body.model}'. Served: {', '.join(served) or 'none'}",
                       code="NOT_FOUND", field="model")
    binary = accepted(request.headers.get(hdrs.ACCEPT))
    if body.output:
        if binary != OCTET:
            raise bad_request("output", f"output: picks the tensor of an Accept: {OCTET} answer; this request "
                                        f"accepts {request.headers.get(hdrs.ACCEPT) or 'JSON'}")
        check_output(info, body.output)
    if binary == OCTET and body.stream:
        raise bad_request("stream", f"stream: one {OCTET} body cannot stream; send Accept: {MULTIPART} for "
                                    "each chunk as it is produced")
    # built as gRPC sends it: spilled files are read from disk then, and the call keeps no copy
    call = client.generate(lambda: to_request(body), (body.timeout_s or settings.request_timeout_s) + DEADLINE_SLACK_S)
    try:
        first = await next_message(call)  # an AioRpcError here becomes an HTTP status in the middleware
        if first is None:
            raise ApiError(500, "conductor ended the stream without a final event", code="INTERNAL")
        if binary == OCTET:
            return await octet_response(call, first, body.output, next_message, settle)
        if binary == MULTIPART:
            return await multipart_stream(request, call, first, next_message, settle)
        if body.stream:
            return await _stream(request, call, first)
        return await _collect(call, first)
    finally:
        if not call.done():
            call.cancel()  # client gone, shutdown or error: the conductor releases the request


async def next_message(call: grpc.aio.UnaryStreamCall) -> cpb.GenerateResponse | None:
    msg = await call.read()
    return None if msg is grpc.aio.EOF else msg


async def settle(call: grpc.aio.UnaryStreamCall) -> None:
    """After the final event, let the call end with its OK status (it follows at once) rather than
    cancel it, so the conductor sees a completed request, not a cancelled one."""
    try:
        await asyncio.wait_for(call.code(), SETTLE_S)
    except TimeoutError:
        log.warning("conductor kept the stream open %g s after the final event; cancelling it", SETTLE_S)


async def _collect(call: grpc.aio.UnaryStreamCall, first: cpb.GenerateResponse) -> web.Response:
    collected, msg = Collected(), first
    while True:
        if msg is None:
            raise ApiError(500, "conductor ended the stream without a final event", code="INTERNAL")
        try:
            for chunk in msg.chunks:
                collected.add(chunk)
        except ProtocolError as e:
            raise ApiError(500, str(e), code="INTERNAL") from None
        if msg.HasField("final"):
            await settle(call)
            return web.json_response(collected.json(msg.request_id, msg.final), headers={"X-Request-Id": msg.request_id})
        msg = await next_message(call)


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def _stream(request: web.Request, call: grpc.aio.UnaryStreamCall, first: cpb.GenerateResponse) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"X-Request-Id": first.request_id, "Cache-Control": "no-cache"})
    resp.content_type = NDJSON
    await resp.prepare(request)
    try:
        try:
            await _pump(resp, call, first)
        except ConnectionResetError:
            raise
        except Exception:  # headers are sent: the error can only be the last line
            log.exception("streaming request %s failed", first.request_id)
            await resp.write(_line(error_json("INTERNAL", "internal gateway error; the gateway log has the traceback")))
        await resp.write_eof()
    except ConnectionResetError:  # the client went away; generate()'s finally cancels the call
        log.info("client disconnected from streaming request %s", first.request_id)
    return resp


async def _pump(resp: web.StreamResponse, call: grpc.aio.UnaryStreamCall, msg: cpb.GenerateResponse | None) -> None:
    """Write each conductor message's lines until the final event or an error line."""
    while True:
        try:
            if msg is None:
                raise ProtocolError("conductor ended the stream without a final event")
            lines = message_lines(msg)
        except ProtocolError as e:
            log.error("streaming request: %s", e)
            await resp.write(_line(error_json("INTERNAL", str(e))))
            return
        await resp.write(lines)
        if msg.HasField("final"):
            await settle(call)
            return
        try:
            msg = await next_message(call)
        except grpc.aio.AioRpcError as e:
            await resp.write(_line(error_json(e.code().name, e.details() or e.code().name)))
            return
