"""Typed errors of the M* SDK, the same for both transports.

Every error carries what the server said: ``code`` (the gRPC status name, e.g.
``"INVALID_ARGUMENT"``, or for purely HTTP failures the gateway's code such as
``"PAYLOAD_TOO_LARGE"``), ``status`` (the HTTP status: the gateway's own over REST, the
gateway's mapping of the gRPC code over gRPC) and ``message``. ``field`` names the request
field at fault where the server named one (``"model_kwargs.max_tokens"``, ``"model"``).
"""

from __future__ import annotations

import http

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

#: gRPC status name -> HTTP status, as the gateway maps them (gateway/errors.py; a test keeps the two equal).
HTTP_STATUS: dict[str, int] = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


class MStarError(Exception):
    """Base of every error the SDK raises for a failed call."""

    #: the code an instance gets when the server named none
    default_code = "UNKNOWN"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 field: str | None = None, request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.status = status if status is not None else HTTP_STATUS.get(self.code, 500)
        self.field = field
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code} ({self.status}): {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, status={self.status}, field={self.field!r}, message={self.message!r})"


class InvalidArgument(MStarError):
    """The request is wrong; ``field`` names the part to change (None when the whole body is)."""

    default_code = "INVALID_ARGUMENT"

    def __init__(self, field: str | None, message: str, **kw):
        super().__init__(message, field=field, **kw)


class Unauthenticated(MStarError):
    """The server needs an API key and got none, or one it does not know (``api_key=``)."""

    default_code = "UNAUTHENTICATED"


class NotFound(MStarError):
    """The model is not served (``field == "model"``) or the route does not exist."""

    default_code = "NOT_FOUND"


class AlreadyExists(MStarError):
    """A request with this request_id is already in flight."""

    default_code = "ALREADY_EXISTS"


class ResourceExhausted(MStarError):
    """The server's admission limit is reached; retry later."""

    default_code = "RESOURCE_EXHAUSTED"


class Cancelled(MStarError):
    """The request was cancelled (by this client, or through Conductor.Cancel)."""

    default_code = "CANCELLED"


class Unavailable(MStarError):
    """The server, or a service behind it, cannot be reached; the message names which."""

    default_code = "UNAVAILABLE"


class DeadlineExceeded(MStarError):
    """The request ran past its timeout."""

    default_code = "DEADLINE_EXCEEDED"


class Internal(MStarError):
    """The server failed, or answered something the public API does not allow."""

    default_code = "INTERNAL"


_BY_CODE: dict[str, type[MStarError]] = {
    "INVALID_ARGUMENT": InvalidArgument, "FAILED_PRECONDITION": InvalidArgument, "OUT_OF_RANGE": InvalidArgument,
    "PAYLOAD_TOO_LARGE": InvalidArgument, "UNSUPPORTED_MEDIA_TYPE": InvalidArgument, "BAD_REQUEST": InvalidArgument,
    "METHOD_NOT_ALLOWED": InvalidArgument,
    "UNAUTHENTICATED": Unauthenticated, "NOT_FOUND": NotFound, "ALREADY_EXISTS": AlreadyExists, "RESOURCE_EXHAUSTED": ResourceExhausted,
    "CANCELLED": Cancelled, "UNAVAILABLE": Unavailable, "DEADLINE_EXCEEDED": DeadlineExceeded,
    "INTERNAL": Internal, "UNKNOWN": Internal, "DATA_LOSS": Internal, "UNIMPLEMENTED": Internal,
}
_BY_STATUS: dict[int, type[MStarError]] = {
    400: InvalidArgument, 401: Unauthenticated, 404: NotFound, 409: AlreadyExists, 413: InvalidArgument, 415: InvalidArgument,
    429: ResourceExhausted, 499: Cancelled, 500: Internal, 502: Unavailable, 503: Unavailable, 504: DeadlineExceeded,
}


def make_error(code: str, message: str, *, status: int | None = None, field: str | None = None,
               request_id: str | None = None) -> MStarError:
    """The typed error for a server-reported ``code`` (falling back on the HTTP ``status``)."""
    cls = _BY_CODE.get(code) or (_BY_STATUS.get(status) if status is not None else None) or MStarError
    kw = {"code": code, "status": status, "request_id": request_id}
    if cls is InvalidArgument:
        return InvalidArgument(field, message, **kw)
    return cls(message, field=field, **kw)


def from_http(status: int, body: object, request_id: str | None = None) -> MStarError:
    """From a gateway error answer: ``{"error": {"message", "code", "field", ...}}``."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):  # not the gateway's answer (a proxy's, say): the status is all there is
        try:
            code = http.HTTPStatus(status).name
        except ValueError:
            code = "UNKNOWN"
        return make_error(code, f"HTTP {status} without an M* error body: {str(body)[:200]!r}", status=status,
                          request_id=request_id)
    field = err.get("field", err.get("param"))
    return make_error(str(err.get("code") or "UNKNOWN"), str(err.get("message") or f"HTTP {status}"),
                      status=status, field=field if isinstance(field, str) else None, request_id=request_id)


def _bad_request_field(error: grpc.Call) -> str | None:
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # details inconsistent with the status
        return None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                return bad.field_violations[0].field
    return None


def from_grpc(error: grpc.RpcError, request_id: str | None = None) -> MStarError:
    """From a failed gRPC call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``)."""
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    field = None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = _bad_request_field(error)  # type: ignore[arg-type]
    elif code == grpc.StatusCode.NOT_FOUND:
        field = "model"  # the conductor's only NOT_FOUND (conductor.proto): an unknown model
    return make_error(code.name, error.details() or code.name, field=field, request_id=request_id)  # type: ignore[attr-defined]
