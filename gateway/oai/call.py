"""One Conductor.Generate call behind an OpenAI route, and the OpenAI error shape.

Errors leave as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (plus M*'s
``field``, equal to ``param``). A conductor INVALID_ARGUMENT about a model kwarg names the
OpenAI parameter it came from (``temperature``, not ``model_kwargs.temperature``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import grpc
from aiohttp import web

from mstar.client.errors import InvalidArgument
from mstar.gateway.body import read_json_object
from mstar.gateway.errors import ApiError, bad_request, from_rpc_error
from mstar.gateway.generate import CLIENT, DEADLINE_SLACK_S, SETTINGS, next_message, settle
from mstar.gateway.oai.params import Params
from mstar.v1 import conductor_pb2 as cpb


def openai_route(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Errors raised before the response started leave in OpenAI's shape."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except InvalidArgument as e:  # from mstar.client.messages
            return bad_request(e.field, e.message).response(openai=True)
        except ApiError as e:
            return e.response(openai=True)
        except grpc.aio.AioRpcError as e:  # ListModels failed
            return from_rpc_error(e).response(openai=True)

    return wrapped


async def openai_body(request: web.Request, shape: str) -> dict:
    """The route's JSON body, read and bounded by json_bounds.SHAPES[shape] (json_body.py)."""
    settings = request.app[SETTINGS]
    return await read_json_object(request, settings.max_upload_bytes, shape, settings.request_timeout_s)


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def outputs_of(info: cpb.ModelInfo, modality: str) -> list[str]:
    """The model's output names of ``modality`` (ModelInfo.outputs holds "name:modality")."""
    return [o.rpartition(":")[0] for o in info.outputs if o.rpartition(":")[2] == modality]


async def model_info(request: web.Request, model: str) -> cpb.ModelInfo:
    """The served model's info (its outputs, its ``api``); 404 naming ``model`` when not served."""
    info, served = await request.app[CLIENT].find_model(model)
    if info is None:
        raise ApiError(404, f"model: unknown model '{model}'. Served: {', '.join(served) or 'none'}",
                       code="NOT_FOUND", field="model")
    return info


async def served_output(request: web.Request, model: str, modality: str, route: str,
                        info: cpb.ModelInfo | None = None) -> str:
    """The output this route reads: the one named like the modality, else the model's first of
    that modality. 404 for an unknown model, 400 naming ``model`` when it has no such output."""
    info = info or await model_info(request, model)
    names = outputs_of(info, modality)
    if not names:
        raise bad_request("model", f"model: model '{model}' has no {modality} output (its outputs: "
                                   f"{', '.join(info.outputs) or 'none'}); {route} needs a model that emits {modality}")
    return modality if modality in names else names[0]


class ConductorStream:
    """Reads the call's messages; errors become ApiErrors named in OpenAI's terms."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, params: Params, model: str, text_param: str):
        self._call, self._params, self._model, self._text_param = call, params, model, text_param

    async def next(self) -> cpb.GenerateResponse | None:
        try:
            return await next_message(self._call)
        except grpc.aio.AioRpcError as e:
            raise self._params.remap(from_rpc_error(e), self._model, self._text_param) from None

    async def settle(self) -> None:
        await settle(self._call)

    async def following(self, first: cpb.GenerateResponse) -> AsyncIterator[cpb.GenerateResponse]:
        """``first``, then every message through the final one (after which the call settles);
        ApiError if the stream ends without a final event."""
        msg: cpb.GenerateResponse | None = first
        while True:
            if msg is None:
                raise ApiError(500, "conductor ended the stream without a final event", code="INTERNAL")
            yield msg
            if msg.HasField("final"):
                await self.settle()
                return
            msg = await self.next()


@asynccontextmanager
async def conductor_call(request: web.Request, model: str, text: str, params: Params,
                         text_param: str, files: Sequence[cpb.InputFile] = ()) -> AsyncIterator[ConductorStream]:
    """Start the call; whatever ends the handler cancels it if still running (client gone,
    shutdown, error), so the conductor releases the request."""
    settings, client = request.app[SETTINGS], request.app[CLIENT]
    req = cpb.GenerateRequest(model=model, text=text, files=list(files),
                              model_kwargs_json=json.dumps(params.model_kwargs) if params.model_kwargs else "")
    call = client.generate(req, settings.request_timeout_s + DEADLINE_SLACK_S)
    try:
        yield ConductorStream(call, params, model, text_param)
    finally:
        if not call.done():
            call.cancel()


def error_event(e: ApiError) -> bytes:
    """An error after the response started: OpenAI streams it as a ``data: {"error": ...}`` event."""
    return sse(e.body(openai=True))


def to_api_error(e: Exception) -> ApiError:
    return e if isinstance(e, ApiError) else ApiError(500, "internal gateway error; the gateway log has the traceback",
                                                      code="INTERNAL")


def api_kwargs(raw: str, what: str) -> dict:
    """A ModelApi ``*_kwargs_json`` field as a dict (empty: none); a malformed one is the conductor's fault."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(500, f"the conductor reported malformed {what} for this model", code="INTERNAL")
    return value
