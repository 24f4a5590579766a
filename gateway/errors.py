"""One JSON error shape for every failure, and the gRPC status → HTTP status mapping.

Body: ``{"error": {"message": str, "type": str, "field": str | null, "code": str}}``; the
OpenAI-compatible routes add ``param`` (= ``field``), the key OpenAI clients read.
``code`` is machine-readable: the conductor's gRPC status name (``UNAVAILABLE``) for errors
it reports, ``INVALID_ARGUMENT`` / ``NOT_FOUND`` for the gateway's own validation, and the
HTTP reason in upper snake case (``PAYLOAD_TOO_LARGE``) for purely HTTP errors.
"""

from __future__ import annotations

import http
import logging

import grpc
from aiohttp import web
from google.rpc import error_details_pb2
from grpc_status import rpc_status

log = logging.getLogger("mstar.gateway")

HTTP_FOR_GRPC: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    # The conductor's answer to a duplicate in-flight request_id: the client's mistake, not ours.
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    # nginx's "client closed request": the request was cancelled (Cancel RPC) before it finished.
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_REASONS = {499: "Client Closed Request"}


class ApiError(Exception):
    """An error answer: HTTP status, message, the request field at fault (if any), code."""

    def __init__(self, status: int, message: str, *, code: str, field: str | None = None,
                 headers: dict[str, str] | None = None):
        """``headers``: sent with the answer (a 429's ``Retry-After``)."""
        super().__init__(message)
        self.status, self.message, self.code, self.field = status, message, code, field
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self, *, openai: bool = False) -> dict:
        """``openai``: also ``param``, OpenAI's name for the field (the OpenAI-compatible routes)."""
        err = {"message": self.message, "type": self.type, "field": self.field, "code": self.code}
        if openai:
            err["param"] = self.field
        return {"error": err}

    def response(self, headers: dict[str, str] | None = None, *, openai: bool = False) -> web.Response:
        return web.json_response(self.body(openai=openai), status=self.status, reason=_REASONS.get(self.status),
                                 headers={**self.headers, **(headers or {})} or None)


def bad_request(field: str | None, message: str) -> ApiError:
    return ApiError(400, message, code="INVALID_ARGUMENT", field=field)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body exceeds the gateway's limit of {limit} bytes ({limit / 2**20:g} MiB)",
                    code="PAYLOAD_TOO_LARGE")


def bad_request_field(error: grpc.aio.AioRpcError) -> str | None:
    """The field named by a ``google.rpc.BadRequest`` detail, if the status carries one."""
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # details inconsistent with the status: ignore them
        return None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                return bad.field_violations[0].field
    return None


def from_rpc_error(error: grpc.aio.AioRpcError) -> ApiError:
    code = error.code()
    field = None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = bad_request_field(error)
    elif code == grpc.StatusCode.NOT_FOUND:
        field = "model"  # the conductor's only NOT_FOUND (conductor.proto): an unknown model
    return ApiError(HTTP_FOR_GRPC.get(code, 500), error.details() or code.name, code=code.name, field=field)


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> ApiError:
    code = "PAYLOAD_TOO_LARGE" if exc.status == 413 else http.HTTPStatus(exc.status).name
    if exc.status in (404, 405):
        message = f"{exc.reason}: {request.method} {request.path}"
    else:
        message = exc.text if exc.content_type == "text/plain" and exc.text else exc.reason
    return ApiError(exc.status, message, code=code)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as the JSON shape above; nothing leaves as aiohttp's HTML page."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except grpc.aio.AioRpcError as e:
        return from_rpc_error(e).response()
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
        if e.status < 400:
            raise
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return _from_http_exception(e, request).response(allow)
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return ApiError(500, "internal gateway error; the gateway log has the traceback", code="INTERNAL").response()
