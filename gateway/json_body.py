"""The one reader of JSON a client sends the gateway: every JSON body (``/generate``, the OpenAI
routes) and JSON form field (a multipart body's ``model_kwargs``) goes through it.

Up to ``INLINE_JSON_BYTES`` (nearly every request) it is parsed on the event loop; past that the
caller waits its turn (json_fair.py) and a worker process parses it (json_pool.py), so that no
body stalls other callers' requests. Either way json_bounds.parse bounds what it may hold, and
a refusal is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from mstar.gateway.auth import caller_of
from mstar.gateway.errors import ApiError, bad_request, too_large
from mstar.gateway.json_bounds import Refused, parse
from mstar.gateway.json_fair import Turns
from mstar.gateway.json_pool import JsonPool
from mstar.limits import INLINE_JSON_BYTES

log = logging.getLogger("mstar.gateway")
JSON_POOL = web.AppKey("json_pool", JsonPool)
TURNS = web.AppKey("json_turns", Turns)


async def json_workers(app: web.Application):
    """cleanup_ctx: the app's JSON workers (started on first use, stopped when idle) and callers' turns."""
    pool = app[JSON_POOL] = JsonPool()
    app[TURNS] = Turns()
    sweeper = asyncio.create_task(_retire_idle(pool))
    yield
    sweeper.cancel()
    await asyncio.to_thread(pool.close)


async def _retire_idle(pool: JsonPool) -> None:
    while True:
        await asyncio.sleep(pool.idle_s / 4)
        try:
            await asyncio.to_thread(pool.retire_idle)
        except Exception:  # the next round tries again
            log.exception("stopping idle JSON workers failed")


async def read_json_body(request: web.Request, max_bytes: int, shape: str, wait_s: float) -> dict:
    """The body, parsed and shaped by ``json_bounds.SHAPES[shape]``; ApiError 400 naming the field,
    413 past ``max_bytes``, 429 when the caller's turn does not come within ``wait_s`` (json_fair.py)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large(max_bytes)
    body = bytearray()
    if request.content_length is None or request.content_length <= INLINE_JSON_BYTES:
        while len(body) <= INLINE_JSON_BYTES and (chunk := await request.content.readany()):
            body += chunk
            if len(body) > max_bytes:
                raise too_large(max_bytes)
        if len(body) <= INLINE_JSON_BYTES:
            return _body(parse(bytes(body), shape))
    end_turn = await request.app[TURNS].take(caller_of(request), wait_s)
    try:  # the rest of the body is read in the caller's turn: until then it waits on the socket
        while chunk := await request.content.readany():
            body += chunk
            if len(body) > max_bytes:
                raise too_large(max_bytes)
    except BaseException:
        end_turn()
        raise
    parsing = _in_turn(request, body, shape, end_turn)  # sent as it is: no copy
    del body  # freed once sent, not held while the request runs on
    return _body(await asyncio.shield(parsing))


async def read_json_field(request: web.Request, name: str, data: bytes, wait_s: float,
                          expected: str | None = None) -> object:
    """A JSON form field's value (any JSON value); 400 naming ``name`` (and where in it) if refused.
    ``expected``: what a malformed one is said to have to be ("a number"); default: the parser's reason."""
    if len(data) <= INLINE_JSON_BYTES:
        result = parse(data, "value")
    else:
        end_turn = await request.app[TURNS].take(caller_of(request), wait_s)
        result = await asyncio.shield(_in_turn(request, data, "value", end_turn))
    if not isinstance(result, Refused):
        return result
    where = f"{name}.{result.path}" if result.path else name
    if result.malformed and expected is not None:
        raise bad_request(name, f"{name}: must be {expected}, got {data[:40].decode(errors='replace')!r}")
    raise bad_request(where, f"{where}: {result.reason}")


def _in_turn(request: web.Request, raw: bytes | bytearray, shape: str, end_turn) -> asyncio.Future:
    """The worker's parse, a future to await shielded: the caller's turn ends when the parse does,
    even if the handler is cancelled first (a client that hangs up cannot free its turn while its
    body still holds a worker)."""
    try:
        parsing = request.app[JSON_POOL].parse(raw, shape)
    except BaseException:
        end_turn()
        raise
    parsing.add_done_callback(lambda _: end_turn())
    return parsing


def _body(result: object) -> Any:
    """A body shape's result (an object: json_bounds._object), or its refusal raised."""
    if not isinstance(result, Refused):
        return result
    if result.path:
        raise bad_request(result.path, f"{result.path}: {result.reason}")
    raise bad_request(None, f"malformed JSON body: {result.reason}" if result.malformed else result.reason)


def check_json_type(request: web.Request) -> None:
    if request.content_type != "application/json":
        sent = request.headers.get("Content-Type", "no Content-Type")
        raise ApiError(415, f"unsupported Content-Type '{sent}'; send application/json", code="UNSUPPORTED_MEDIA_TYPE")
