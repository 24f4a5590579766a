"""``POST /v1/audio/speech``: OpenAI text-to-speech over one Conductor.Generate call, for any
model with an audio output (PCM16 mono chunks, each with its sample rate).

- ``input`` is the prompt text; ``voice`` goes to the model as ``model_kwargs.voice`` (left
  out when absent, null or ``"default"``; a model without voices refuses any other: a 400
  naming ``voice``); the sampling knobs ``temperature``, ``top_p``, ``seed`` and
  ``max_tokens`` (M*'s extensions, as on chat completions) go to the model under the same
  names; ``model_kwargs`` (M*'s extension) adds model-specific knobs. A model's
  ``api.speech_kwargs`` go along (Qwen3-Omni: a system prompt telling it to repeat the input,
  so that its Talker speaks the input text: a TTS front on the model's own speech path; how
  faithfully it repeats is the checkpoint's doing. Orpheus: none).
- ``response_format``: ``wav`` (default) or ``pcm`` (raw PCM16 little-endian mono; the rate is
  in ``X-Sample-Rate-Hz``). mp3/opus/aac/flac are a 400.
- ``stream_format``: ``audio`` (default: the bytes stream as the model makes them, the first ones
  with the first audio chunk; ``wav`` starts with a streaming header whose RIFF and data sizes are
  0xFFFFFFFF, "unknown", as streaming TTS servers send it; an error after the first byte cuts the
  connection, so the body is visibly incomplete) or ``sse``
  (``speech.audio.delta`` events with base64 PCM16, then ``speech.audio.done`` with usage;
  needs ``response_format: pcm``).
"""

from __future__ import annotations

import base64
import logging
import struct

from aiohttp import web

from mstar.gateway.errors import ApiError, bad_request
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
from mstar.gateway.oai.params import INTEGER, NUMBER, STRING, Known, Params, exactly

log = logging.getLogger("mstar.gateway")
ROUTE = "/v1/audio/speech"
KNOWN: dict[str, Known] = {
    "speed": (lambda v: NUMBER[1](v) and v == 1, "M* speaks at the model's own pace; leave speed out or send 1.0"),
    "instructions": (exactly(""), "M* models take no speaking instructions"),
}
#: sampling knobs taken at top level, passed to the model as model_kwargs of the same name
KNOBS = {"temperature": NUMBER, "top_p": NUMBER, "seed": INTEGER, "max_tokens": INTEGER}
MIME = {"wav": "audio/wav", "pcm": "audio/pcm"}


def _parse(body: dict) -> tuple[Params, str, str, str, str]:
    p = Params(body)
    model = p.string("model", required=True)
    text = p.string("input", required=True)
    voice = p.take("voice", STRING)
    if voice is not None and voice != "default":
        p.model_kwargs["voice"] = voice
        p.param_of["voice"] = "voice"
    for name, kind in KNOBS.items():
        p.knob(name, kind)
    fmt = p.string("response_format", choices=("wav", "pcm"), default="wav")
    stream_format = p.string("stream_format", choices=("audio", "sse"), default="audio")
    if stream_format == "sse" and fmt != "pcm":
        raise bad_request("response_format", "response_format: with stream_format 'sse' the audio deltas are PCM16; "
                                             "send response_format 'pcm'")
    p.extension_kwargs()
    p.finish(KNOWN, ROUTE)
    return p, model, text, fmt, stream_format


def _rate(chunk, rate: int | None) -> int:
    if not chunk.sample_rate_hz:
        raise ApiError(500, f"audio chunk {chunk.index} of '{chunk.name}' carries no sample rate", code="INTERNAL")
    if rate is not None and chunk.sample_rate_hz != rate:
        raise ApiError(500, f"audio output '{chunk.name}' changed sample rate mid-stream ({rate} -> "
                            f"{chunk.sample_rate_hz} Hz)", code="INTERNAL")
    return chunk.sample_rate_hz


def _no_audio(model: str, output: str) -> ApiError:
    return ApiError(500, f"model '{model}' finished without audio on its output '{output}'", code="INTERNAL")


@openai_route
async def speech(request: web.Request) -> web.StreamResponse:
    params, model, text, fmt, stream_format = _parse(await openai_body(request, "speech"))
    info = await model_info(request, model)
    output = await served_output(request, model, "audio", ROUTE, info)
    params.route_kwargs(api_kwargs(info.api.speech_kwargs_json, "speech kwargs"), f"speech with model '{model}'")
    async with conductor_call(request, model, text, params, "input") as call:
        first = await call.next()
        if first is None:
            raise ApiError(500, "conductor ended the stream without a final event", code="INTERNAL")
        if stream_format == "sse":
            return await _sse(request, call, first, output)
        return await _audio(request, call, first, model, output, fmt)


#: a WAV file's length when it is not known yet (RIFF and data chunk sizes): readers play to the end
UNKNOWN_SIZE = 0xFFFFFFFF


def streaming_wav_header(sample_rate_hz: int) -> bytes:
    """The 44-byte header of a mono PCM16 WAV whose length is unknown."""
    return (b"RIFF" + struct.pack("<I", UNKNOWN_SIZE) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate_hz, sample_rate_hz * 2, 2, 16)
            + b"data" + struct.pack("<I", UNKNOWN_SIZE))


async def _audio(request: web.Request, call, first, model: str, output: str, fmt: str) -> web.StreamResponse:
    """PCM16 as it comes (``wav``: behind a streaming header); headers wait for the first audio
    chunk (they carry its rate)."""
    resp, rate = None, None
    try:
        async for msg in call.following(first):
            data = bytearray()
            for c in msg.chunks:
                if c.name == output:
                    rate = _rate(c, rate)
                    data += c.data
            if resp is None and rate is not None:
                resp = web.StreamResponse(headers={"X-Request-Id": first.request_id, "X-Sample-Rate-Hz": str(rate),
                                                   "Cache-Control": "no-cache"})
                resp.content_type = MIME[fmt]
                await resp.prepare(request)
                if fmt == "wav":
                    data[:0] = streaming_wav_header(rate)
            if resp is not None and data:
                await resp.write(bytes(data))
        if resp is None:
            raise _no_audio(model, output)
        await resp.write_eof()
        return resp
    except ConnectionResetError:
        log.info("client disconnected from streaming speech %s", first.request_id)
        return resp or web.Response(status=499)
    except Exception as e:
        if resp is None:
            raise  # nothing sent yet: an HTTP error status
        # Raw audio has no room for an error: cut the connection so the body is visibly incomplete.
        log.error("streaming speech %s failed after audio was sent: %s", first.request_id, to_api_error(e).message)
        if request.transport is not None:
            request.transport.close()
        return resp


async def _sse(request: web.Request, call, first, output: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"X-Request-Id": first.request_id, "Cache-Control": "no-cache"})
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    try:
        try:
            rate = None
            async for msg in call.following(first):
                out = bytearray()
                for c in msg.chunks:
                    if c.name == output:
                        rate = _rate(c, rate)
                        out += sse({"type": "speech.audio.delta", "audio": base64.b64encode(c.data).decode("ascii"),
                                    "sample_rate_hz": rate})
                if msg.HasField("final"):
                    u = msg.final.usage
                    out += sse({"type": "speech.audio.done", "usage": {
                        "input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                        "total_tokens": u.prompt_tokens + u.completion_tokens}})
                if out:
                    await resp.write(bytes(out))
        except ConnectionResetError:
            raise
        except Exception as e:
            if not isinstance(e, ApiError):
                log.exception("streaming speech %s failed", first.request_id)
            await resp.write(error_event(to_api_error(e)))
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client disconnected from streaming speech %s", first.request_id)
    return resp
