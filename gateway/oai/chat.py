"""``POST /v1/chat/completions``: OpenAI chat completions over one Conductor.Generate call.

- The prompt is what ``mstar.client.messages.prompt_from_messages`` makes of ``messages``
  (the last message, a user message; earlier ones are checked, not sent).
- The answer is the model's text output named ``text`` (else its first text output); a
  model with none is a 400 naming ``model``.
- ``max_tokens`` / ``max_completion_tokens`` become ``model_kwargs.max_tokens``;
  ``temperature``, ``top_p``, ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``
  pass through under their own names, and the model accepts or refuses each (a refusal is a
  400 naming the OpenAI parameter). ``model_kwargs`` (M*'s extension) adds model-specific knobs.
- ``usage`` is the final event's counts. Streaming is SSE: a role delta, one content delta
  per text chunk, a last chunk with ``finish_reason``, a usage chunk when
  ``stream_options.include_usage``, then ``data: [DONE]``; an error after the first event is a
  ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from mstar.client.messages import prompt_from_messages
from mstar.gateway.body import read_json_object
from mstar.gateway.errors import ApiError, bad_request
from mstar.gateway.generate import SETTINGS
from mstar.gateway.oai.call import conductor_call, error_event, openai_route, served_output, sse, to_api_error
from mstar.gateway.oai.params import (
    ARRAY,
    BOOL,
    INTEGER,
    NUMBER,
    OBJECT,
    STRING_OR_STRINGS,
    Known,
    Params,
    exactly,
    never,
)

log = logging.getLogger("mstar.gateway")
ROUTE = "/v1/chat/completions"

#: OpenAI parameters M* does not honour: the values that change nothing pass, others are a 400 with the reason.
KNOWN: dict[str, Known] = {
    "n": (exactly(1), "M* returns one choice; leave n out or send 1"),
    "logprobs": (exactly(False), "M* does not return log probabilities"),
    "top_logprobs": (exactly(0), "M* does not return log probabilities"),
    "logit_bias": (exactly({}), "M* models take no logit bias"),
    "tools": (exactly([]), "M* models do not call tools"),
    "tool_choice": (exactly("none"), "M* models do not call tools"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "M* models do not call tools"),
    "functions": (exactly([]), "M* models do not call functions"),
    "function_call": (exactly("none"), "M* models do not call functions"),
    "response_format": (exactly({"type": "text"}), "M* returns plain text; only {\"type\": \"text\"}"),
    "modalities": (exactly(["text"]), "chat completions return text; use /v1/audio/speech for audio"),
    "audio": (never, "chat completions return text; use /v1/audio/speech for audio"),
    "store": (exactly(False), "M* does not store completions"),
    "user": (lambda v: isinstance(v, str), "must be a string"),  # an end-user id: informational
    "safety_identifier": (lambda v: isinstance(v, str), "must be a string"),  # informational too
    "metadata": (lambda v: isinstance(v, dict), "must be an object"),
    "prediction": (never, "M* does not use predicted outputs"),
    "reasoning_effort": (never, "no M* model has a reasoning setting"),
    "verbosity": (never, "no M* model has a verbosity setting"),
    "web_search_options": (never, "M* does not search the web"),
    "service_tier": (lambda v: v in ("auto", "default") and isinstance(v, str), "M* has one service tier"),
    "prompt_cache_key": (never, "M* has no prompt cache keys"),
}


def _parse(body: dict) -> tuple[Params, str, str, bool, bool]:
    p = Params(body)
    model = p.string("model", required=True)
    text = prompt_from_messages(p.take("messages", ARRAY, required=True))
    stream = bool(p.take("stream", BOOL))
    options = p.take("stream_options", OBJECT) or {}
    if options and not stream:
        raise bad_request("stream_options", "stream_options: only with stream: true")
    for key in options:
        if key != "include_usage":
            raise bad_request(f"stream_options.{key}", f"stream_options.{key}: not supported; only include_usage")
    include_usage = options.get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise bad_request("stream_options.include_usage", "stream_options.include_usage: must be a boolean")
    p.knob("max_tokens", INTEGER)
    p.knob("max_completion_tokens", INTEGER, kwarg="max_tokens")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        p.knob(name, NUMBER)
    p.knob("seed", INTEGER)
    p.knob("stop", STRING_OR_STRINGS)
    p.extension_kwargs()
    p.finish(KNOWN, ROUTE)
    return p, model, text, stream, include_usage


@openai_route
async def chat_completions(request: web.Request) -> web.StreamResponse:
    params, model, text, stream, include_usage = _parse(await read_json_object(request, request.app[SETTINGS].max_upload_bytes))
    output = await served_output(request, model, "text", ROUTE)
    created = int(time.time())
    async with conductor_call(request, model, text, params, "messages") as call:
        first = await call.next()  # errors before the first message are an HTTP status
        if first is None:
            raise ApiError(500, "conductor ended the stream without a final event", code="INTERNAL")
        head = {"id": f"chatcmpl-{first.request_id}", "created": created, "model": model, "system_fingerprint": None}
        if not stream:
            return await _complete(call, first, head, output)
        return await _stream(request, call, first, head, output, include_usage)


async def _complete(call, first, head: dict, output: str) -> web.Response:
    parts: list[str] = []
    async for msg in call.following(first):
        parts.extend(c.text for c in msg.chunks if c.name == output)
        final = msg.final
    body = {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts), "refusal": None},
                         "logprobs": None, "finish_reason": final.finish_reason}],
            "usage": _usage(final.usage)}
    return web.json_response(body, headers={"X-Request-Id": first.request_id})


def _usage(u) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


async def _stream(request: web.Request, call, first, head: dict, output: str, include_usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"X-Request-Id": first.request_id, "Cache-Control": "no-cache"})
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    extra = {"usage": None} if include_usage else {}

    def event(delta: dict, finish_reason: str | None = None) -> bytes:
        return sse({**head, "object": "chat.completion.chunk", **extra,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]})

    try:
        await resp.write(event({"role": "assistant", "content": ""}))
        try:
            async for msg in call.following(first):
                out = b"".join(event({"content": c.text}) for c in msg.chunks if c.name == output and c.text)
                if msg.HasField("final"):
                    out += event({}, msg.final.finish_reason)
                    if include_usage:
                        out += sse({**head, "object": "chat.completion.chunk", "choices": [],
                                    "usage": _usage(msg.final.usage)})
                    out += sse("[DONE]")
                if out:
                    await resp.write(out)
        except ConnectionResetError:
            raise
        except Exception as e:  # headers are sent: the error can only be an event
            if not isinstance(e, ApiError):
                log.exception("streaming chat completion %s failed", first.request_id)
            await resp.write(error_event(to_api_error(e)))
        await resp.write_eof()
    except ConnectionResetError:  # the client went away; conductor_call cancels the call
        log.info("client disconnected from streaming chat completion %s", first.request_id)
    return resp
