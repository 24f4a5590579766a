"""Qwen3-Omni's public API on one served mesh (in-process, real gRPC, the tiny random checkpoint, the
real gateway app on a loopback port): /v1/chat/completions with ``modalities: ["text", "audio"]``
answers ``message.audio`` (WAV) and streams ``delta.audio`` (PCM16 and transcript deltas) equal to
native /generate's text and audio for the same request; audio, image and video content parts reach
the model as /generate's files do; /v1/audio/speech speaks through the model's speech path; the
SDK's chat(modalities=..., audio=...) (sync, streamed, asyncio) gives the same; bad media, voices,
formats and modalities are 400s naming the field sent."""

import asyncio
import base64
import dataclasses
import io
import json
import urllib.request
import wave

import pytest
from served_gateway import ServedGateway, sse_events
from test_serving import config, mp4_bytes, png_bytes, wav_bytes

from mstar.client import AsyncMStarClient, InvalidArgument, MStarClient
from mstar.models.qwen3_omni.model import READ_ALOUD

GREEDY = {"talker_temperature": 0.0, "max_audio_frames": 20}


@pytest.fixture(scope="module")
def gw(checkpoint):
    cfg = config("default", checkpoint)
    cfg = dataclasses.replace(cfg, model_kwargs={**cfg.model_kwargs, "max_audio_seconds": 2.0})
    with ServedGateway(cfg) as g:
        yield g


def native(gw, text, kw, files=()):
    """POST /generate: (text, PCM16 bytes) of the collected outputs."""
    if files:
        fields = {"model": "qwen3_omni", "text": text, "model_kwargs": json.dumps(kw)}
        status, body = gw.post_form("/generate", fields, {n: (n, d, t) for n, t, d in files})
    else:
        status, body = gw.post_json("/generate", {"model": "qwen3_omni", "text": text, "model_kwargs": kw})
    assert status == 200, body
    out = body["outputs"]
    audio = base64.b64decode(out["audio"]["data_b64"]) if "audio" in out else b""
    return out["text"]["text"], audio


def chat(text="Hello there!", **kw):
    return {"model": "qwen3_omni", "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0,
            "model_kwargs": GREEDY, **kw}


def pcm_of_wav(data: bytes) -> tuple[int, bytes]:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        return w.getframerate(), w.readframes(w.getnframes())


NATIVE = {"modalities": ["text", "audio"], "voice": "chelsie", "max_tokens": 8, "temperature": 0.0, **GREEDY}


def test_chat_answers_text_and_audio_as_generate_does(gw):
    status, out = gw.post_json("/v1/chat/completions", chat(modalities=["text", "audio"],
                                                            audio={"voice": "chelsie", "format": "wav"}))
    assert status == 200, out
    message = out["choices"][0]["message"]
    assert message["content"] is None and set(message["audio"]) == {"id", "data", "expires_at", "transcript"}
    rate, pcm = pcm_of_wav(base64.b64decode(message["audio"]["data"]))
    text, audio = native(gw, "Hello there!", NATIVE)
    assert message["audio"]["transcript"] == text and rate == 24000
    assert pcm == audio and len(pcm) > 0


def test_chat_streams_transcript_and_pcm16_deltas(gw):
    status, raw = gw.post_json("/v1/chat/completions", chat(modalities=["text", "audio"], stream=True,
                                                            audio={"voice": "chelsie", "format": "pcm16"}))
    assert status == 200, raw
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": None}
    audio = [d["audio"] for d in deltas if "audio" in d]
    assert len({a["id"] for a in audio}) == 1 and "expires_at" in audio[-1]
    transcript = "".join(a.get("transcript", "") for a in audio)
    pcm = b"".join(base64.b64decode(a["data"]) for a in audio if "data" in a)
    assert len([a for a in audio if "data" in a]) > 1  # streamed chunk by chunk
    text, want = native(gw, "Hello there!", NATIVE)
    assert transcript == text and pcm == want


def test_text_only_chat_sends_modalities_text(gw):
    status, out = gw.post_json("/v1/chat/completions", chat())
    assert status == 200, out
    assert "audio" not in out["choices"][0]["message"]
    text, audio = native(gw, "Hello there!", {**NATIVE, "modalities": ["text"], "voice": "ethan"})
    assert out["choices"][0]["message"]["content"] == text and audio == b""


def _url(mime, data):
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_audio_image_and_video_parts_reach_the_model(gw):
    parts = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(0.6)).decode(), "format": "wav"}},
             {"type": "image_url", "image_url": {"url": _url("image/png", png_bytes())}},
             {"type": "video_url", "video_url": {"url": _url("video/mp4", mp4_bytes())}},
             {"type": "text", "text": "What is this?"}]
    status, out = gw.post_json("/v1/chat/completions", chat(parts))
    assert status == 200, out
    files = [("a.wav", "audio/wav", wav_bytes(0.6)), ("p.png", "image/png", png_bytes()), ("v.mp4", "video/mp4", mp4_bytes())]
    text, _ = native(gw, "What is this?", {**NATIVE, "modalities": ["text"], "voice": "ethan"}, files)
    assert out["choices"][0]["message"]["content"] == text
    assert out["usage"]["prompt_tokens"] > 30  # the media's placeholders are in the prompt


def test_speech_speaks_the_input_through_the_models_speech_path(gw):
    body = {"model": "qwen3_omni", "input": "Good morning.", "voice": "aiden", "response_format": "pcm",
            "temperature": 0.0, "max_tokens": 6, "model_kwargs": GREEDY}
    status, headers, pcm = gw.post("/v1/audio/speech", json.dumps(body).encode(), "application/json")
    assert status == 200 and headers["X-Sample-Rate-Hz"] == "24000", pcm
    _, want = native(gw, "Good morning.", {**NATIVE, "voice": "aiden", "max_tokens": 6, "system": READ_ALOUD})
    assert pcm == want and len(pcm) > 0


def test_sdk_chat_with_audio_sync_streamed_and_async(gw):
    _, want = native(gw, "Hello there!", NATIVE)
    kw = dict(max_tokens=8, temperature=0.0, **GREEDY)
    with MStarClient(gw.url, timeout=120) as client:
        api = client.models()[0].api
        assert api.voices == ("aiden", "chelsie", "ethan") and api.chat_audio_output == "audio"
        result = client.chat("Hello there!", modalities=["text", "audio"], audio={"voice": "chelsie"}, **kw)
        assert result.audio.pcm == want and result.audio.sample_rate_hz == 24000
        chunks = list(client.chat("Hello there!", modalities=["text", "audio"], audio={"voice": "chelsie"}, stream=True,
                                  **kw))
        assert b"".join(c.data for c in chunks if c.name == "audio") == want
        assert client.chat("Hello there!", **kw).audio is None  # text unless audio is asked for
        with pytest.raises(InvalidArgument) as e:
            client.chat("Hello", modalities=["text", "audio"], audio={"voice": "nobody"})
        assert e.value.field == "audio.voice"
        described = client.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _url("image/png", png_bytes())}},
            {"type": "text", "text": "What is this?"}]}], max_tokens=4, temperature=0.0)
        same = client.chat("What is this?", images=[png_bytes()], max_tokens=4, temperature=0.0)
        assert described.text == same.text

    async def go():
        async with AsyncMStarClient(f"grpc://{gw.mesh.address}", timeout=120) as client:
            return await client.chat("Hello there!", modalities=["text", "audio"], audio={"voice": "chelsie"}, **kw)

    assert asyncio.run(asyncio.wait_for(go(), 120)).audio.pcm == want


def _audio_part(data: bytes, fmt="wav"):
    return [{"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}},
            {"type": "text", "text": "hi"}]


BAD = [
    (chat(modalities=["text", "audio"], audio={"voice": "nobody"}), "audio.voice"),
    (chat(modalities=["text", "audio"], audio={"format": "mp3"}), "audio.format"),
    (chat(modalities=["text", "audio"], audio={"format": "wav"}, stream=True), "audio.format"),
    (chat(modalities=["text", "audio"], audio={"voice": "ethan", "speed": "1"}), "audio.speed"),
    (chat(modalities=["audio"]), "modalities"),
    (chat(audio={"voice": "ethan"}), "audio"),
    (chat(model_kwargs={"modalities": ["text"]}), "model_kwargs.modalities"),
    (chat(_audio_part(b"RIFF-not-a-wav")), "messages[0].content[0]"),
    (chat(_audio_part(wav_bytes(3.0, rate=8000))), "messages[0].content[0]"),  # past max_audio_seconds
    (chat(_audio_part(b"ID3\x03 not really an mp3", "mp3")), "messages[0].content[0]"),
    (chat(_audio_part(wav_bytes(0.2), "flac")), "messages[0].content[0].input_audio.format"),
    (chat([{"type": "video_url", "video_url": {"url": _url("video/mp4", b"\x00\x00\x00\x18ftypmp42 broken")}}]),
     "messages[0].content[0]"),
    (chat([{"type": "image_url", "image_url": {"url": _url("image/png", b"\x89PNG broken")}}]), "messages[0].content[0]"),
    (chat([{"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}]),
     "messages[0].content[0].video_url.url"),
]


@pytest.mark.parametrize("body, field", BAD)
def test_bad_requests_name_the_field(gw, body, field):
    status, out = gw.post_json("/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == field, out
    assert out["error"]["message"].startswith(field), out


def test_bad_speech_voice_names_voice(gw):
    status, out = gw.post_json("/v1/audio/speech", {"model": "qwen3_omni", "input": "Hi", "voice": "nobody"})
    assert status == 400 and out["error"]["param"] == "voice", out


def test_models_show_voices_and_formats(gw):
    with urllib.request.urlopen(gw.url + "/v1/models", timeout=10) as r:
        (m,) = json.loads(r.read())["data"]
    api = m["api"]
    assert api["chat_audio_output"] == "audio" and api["audio_formats"] == ["wav", "pcm16"]
    assert api["voices"] == ["aiden", "chelsie", "ethan"] and api["default_voice"] == "ethan"
    assert api["chat_media"] == ["audio", "image", "video"] and api["edit_kwargs"] is None
