"""``POST /v1/chat/completions``: OpenAI chat completions over one Conductor.Generate call.

- The prompt is what ``mstar.client.messages.chat_from_messages`` makes of ``messages``
  (the last message, a user message; earlier ones are checked, not sent). Its media parts
  become the request's files, in order: ``image_url`` (image), ``input_audio`` (``{data: base64,
  format: wav | mp3}``) and M*'s ``video_url`` (``{url: "data:video/mp4;base64,..."}``, shaped
  like image_url). URLs must be inline ``data:`` URLs: the gateway fetches nothing. A media kind
  the model does not declare (``ModelInfo.api.chat_media``) is a 400 naming the part; a file
  the model cannot decode is a 400 naming the part too (``messages[0].content[1]``).
- The model's ``api.chat_kwargs`` go along as model kwargs (BAGEL: ``mode: understand``).
- The answer is the model's text output named ``text`` (else its first text output); a
  model with none is a 400 naming ``model``.
- ``modalities: ["text", "audio"]`` and ``audio: {voice, format}``, for a model whose api
  declares a chat audio output (Qwen3-Omni): ``voice`` one of ``api.voices`` (default
  ``api.default_voice``), ``format`` one of ``api.audio_formats`` (``wav`` or ``pcm16``; default
  ``wav``, and streaming needs ``pcm16``, as OpenAI's). Sent as model kwargs ``modalities`` (always,
  to such a model: ``["text"]`` unless audio is asked for) and ``voice``. The answer then has
  ``message.content: null`` and ``message.audio: {id, data (base64 WAV or PCM16), expires_at,
  transcript}``, as OpenAI's; M* keeps no audio for later turns, so ``expires_at`` is the
  creation time. Streamed: ``delta.audio.transcript`` text deltas and ``delta.audio.data`` base64
  PCM16 deltas (24 kHz mono little-endian), each with the audio's ``id``, and a last
  ``delta.audio`` with ``expires_at``. Audio asked of a text-only model is a 400 naming
  ``modalities``; ``audio`` without it is a 400 naming ``audio``.
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

import base64
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from mstar.client.messages import ChatInput
from mstar.client.types import pcm16_wav
from mstar.gateway.errors import ApiError, bad_request
from mstar.gateway.json_bounds import ReadMessages
from mstar.gateway.oai.call import (
    api_kwargs,
    conductor_call,
    error_event,
    model_info,
    openai_body,
    openai_route,
    served_output,
    sse,
    to_api_error,
)
from mstar.gateway.oai.media import media_files
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
from mstar.v1 import conductor_pb2 as cpb

log = logging.getLogger("mstar.gateway")
ROUTE = "/v1/chat/completions"
#: ``messages`` as the body's reader leaves them: read, by chat_from_messages (json_bounds.chat)
MESSAGES = ("an array", lambda v: isinstance(v, ReadMessages))

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


@dataclass
class ChatRequest:
    params: Params
    model: str
    chat: ChatInput
    stream: bool
    include_usage: bool
    #: the client's modalities (None: absent) and audio options (None: absent)
    modalities: list | None
    audio: dict | None


@dataclass(frozen=True)
class AudioOut:
    """What a chat answer speaks: the model's audio output, in which format."""

    output: str
    format: str  # "wav" | "pcm16"
    id: str = ""


def _parse(body: dict) -> ChatRequest:
    p = Params(body)
    model = p.string("model", required=True)
    chat = p.take("messages", MESSAGES, required=True).result()
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
    modalities = p.take("modalities", ARRAY)
    if modalities is not None and (sorted(modalities, key=str) not in (["text"], ["audio", "text"])
                                   or len(set(map(str, modalities))) != len(modalities)):
        raise bad_request("modalities", 'modalities: must be ["text"] or ["text", "audio"]')
    audio = p.take("audio", OBJECT)
    for key in audio or {}:
        if key not in ("voice", "format"):
            raise bad_request(f"audio.{key}", f"audio.{key}: not supported; audio takes voice and format")
        if not isinstance(audio[key], str):
            raise bad_request(f"audio.{key}", f"audio.{key}: must be a string")
    p.knob("max_tokens", INTEGER)
    p.knob("max_completion_tokens", INTEGER, kwarg="max_tokens")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        p.knob(name, NUMBER)
    p.knob("seed", INTEGER)
    p.knob("stop", STRING_OR_STRINGS)
    p.extension_kwargs()
    p.finish(KNOWN, ROUTE)
    return ChatRequest(p, model, chat, stream, include_usage, modalities, audio)


def _audio_out(r: ChatRequest, api: cpb.ModelApi) -> AudioOut | None:
    """The audio this answer carries (None: text only), checked against what the model declares;
    sets the model kwargs ``modalities`` and ``voice``."""
    wants = r.modalities is not None and "audio" in r.modalities
    if not api.chat_audio_output:
        if wants:
            raise bad_request("modalities", f"modalities: model '{r.model}' answers chat in text only; "
                                            'send ["text"] or leave modalities out')
        if r.audio is not None:
            raise bad_request("audio", f"audio: model '{r.model}' answers chat in text only")
        return None
    r.params.set_kwarg("modalities", ["text", "audio"] if wants else ["text"], "modalities")
    if not wants:
        if r.audio is not None:
            raise bad_request("audio", 'audio: only with modalities ["text", "audio"]')
        return None
    audio = r.audio or {}
    voice = audio.get("voice", api.default_voice)
    if voice and voice.lower() not in [v.lower() for v in api.voices]:
        raise bad_request("audio.voice", f"audio.voice: model '{r.model}' has no voice {voice!r}; its voices: "
                                         f"{', '.join(api.voices) or 'none'}")
    if voice:
        r.params.set_kwarg("voice", voice, "audio.voice")
    fmt = audio.get("format", "pcm16" if r.stream else "wav")
    if fmt not in api.audio_formats:
        raise bad_request("audio.format", f"audio.format: {fmt!r} is not available from model '{r.model}'; use one of "
                                          f"{', '.join(api.audio_formats) or 'none'}")
    if r.stream and fmt != "pcm16":
        raise bad_request("audio.format", "audio.format: streamed audio is pcm16 (as OpenAI's); send format 'pcm16'")
    return AudioOut(api.chat_audio_output, fmt)


@openai_route
async def chat_completions(request: web.Request) -> web.StreamResponse:
    r = _parse(await openai_body(request, "chat"))
    info = await model_info(request, r.model)
    output = await served_output(request, r.model, "text", ROUTE, info)
    files = media_files(r.chat.media, info.api, r.model)
    r.params.file_params, r.params.files_param = [m.where for m in r.chat.media], "messages"
    r.params.route_kwargs(api_kwargs(info.api.chat_kwargs_json, "chat kwargs"), f"chat with model '{r.model}'")
    audio = _audio_out(r, info.api)
    created = int(time.time())
    async with conductor_call(request, r.model, r.chat.text, r.params, "messages", files) as call:
        first = await call.next()  # errors before the first message are an HTTP status
        if first is None:
            raise ApiError(500, "conductor ended the stream without a final event", code="INTERNAL")
        head = {"id": f"chatcmpl-{first.request_id}", "created": created, "model": r.model, "system_fingerprint": None}
        if audio is not None:
            audio = AudioOut(audio.output, audio.format, f"audio_{first.request_id}")
        if not r.stream:
            return await _complete(call, first, head, output, audio)
        return await _stream(request, call, first, head, output, r.include_usage, audio)


#: the sample rate OpenAI's pcm16 means
PCM16_RATE = 24_000


def _rate(chunk, fmt: str, rate: int | None) -> int:
    if not chunk.sample_rate_hz or (rate is not None and chunk.sample_rate_hz != rate):
        raise ApiError(500, f"audio output '{chunk.name}' has no steady sample rate", code="INTERNAL")
    if fmt == "pcm16" and chunk.sample_rate_hz != PCM16_RATE:
        raise ApiError(500, f"audio output '{chunk.name}' is {chunk.sample_rate_hz} Hz, not pcm16's {PCM16_RATE}",
                       code="INTERNAL")
    return chunk.sample_rate_hz


async def _complete(call, first, head: dict, output: str, audio: AudioOut | None) -> web.Response:
    parts: list[str] = []
    pcm, rate = bytearray(), None
    async for msg in call.following(first):
        for c in msg.chunks:
            if c.name == output:
                parts.append(c.text)
            elif audio is not None and c.name == audio.output:
                rate = _rate(c, audio.format, rate)
                pcm += c.data
        final = msg.final
    text = "".join(parts)
    message: dict = {"role": "assistant", "content": text, "refusal": None}
    if audio is not None:
        data = pcm16_wav(bytes(pcm), rate or PCM16_RATE) if audio.format == "wav" else bytes(pcm)
        message["content"] = None  # OpenAI's shape: the text is the audio's transcript
        message["audio"] = {"id": audio.id, "data": base64.b64encode(data).decode("ascii"),
                            "expires_at": head["created"], "transcript": text}
    body = {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": final.finish_reason}],
            "usage": _usage(final.usage)}
    return web.json_response(body, headers={"X-Request-Id": first.request_id})


def _usage(u) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


async def _stream(request: web.Request, call, first, head: dict, output: str, include_usage: bool,
                  audio: AudioOut | None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"X-Request-Id": first.request_id, "Cache-Control": "no-cache"})
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    extra = {"usage": None} if include_usage else {}

    def event(delta: dict, finish_reason: str | None = None) -> bytes:
        return sse({**head, "object": "chat.completion.chunk", **extra,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]})

    def deltas(msg) -> bytes:
        nonlocal rate
        out = bytearray()
        for c in msg.chunks:
            if c.name == output and c.text:
                out += event({"content": c.text} if audio is None else {"audio": {"id": audio.id, "transcript": c.text}})
            elif audio is not None and c.name == audio.output and c.data:
                rate = _rate(c, audio.format, rate)
                out += event({"audio": {"id": audio.id, "data": base64.b64encode(c.data).decode("ascii")}})
        return bytes(out)

    rate = None
    try:
        await resp.write(event({"role": "assistant", "content": "" if audio is None else None}))
        try:
            async for msg in call.following(first):
                out = deltas(msg)
                if msg.HasField("final"):
                    if audio is not None:
                        out += event({"audio": {"id": audio.id, "expires_at": head["created"]}})
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
