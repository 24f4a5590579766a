"""The OpenAI-compatible routes against the fake conductor: paths a real toy mesh cannot take
(a model with image output, a conductor failing mid-stream, a 24 kHz voice). The toy-mesh side,
through the official openai package, is tests/clients/test_openai.py."""

import asyncio
import base64
import io
import json
import wave

import aiohttp
import gateway_harness
import grpc
import pytest
from gateway_harness import AUDIO, RID, WAIT_S, gateway, run

from mstar.v1 import conductor_pb2 as cpb

PNG = [b"\x89PNG\r\n\x1a\nfirst", b"\x89PNG\r\n\x1a\nsecond"]
CHAT = {"model": "toy", "messages": [{"role": "user", "content": "hi"}]}


def image_script(request_id: str) -> list[cpb.GenerateResponse]:
    chunks = [cpb.OutputChunk(name="image", modality=cpb.MODALITY_IMAGE, data=d, mime_type="image/png", index=i)
              for i, d in enumerate(PNG)]
    final = cpb.FinalEvent(usage=cpb.Usage(prompt_tokens=2), finish_reason="stop")
    return [cpb.GenerateResponse(request_id=request_id, chunks=chunks[:1]),
            cpb.GenerateResponse(request_id=request_id, chunks=chunks[1:], final=final)]


def sse_events(raw: bytes) -> list:
    return [line[len("data: "):] for line in raw.decode().split("\n\n") if line.startswith("data: ")]


def test_images_for_a_model_with_image_output(monkeypatch):
    monkeypatch.setattr(gateway_harness, "script", image_script)

    async def go():
        async with gateway() as env:
            env.fake.models = [cpb.ModelInfo(name="painter", outputs=["image:image"], walks=["paint"])]
            async with env.client.post("/v1/images/generations", json={"model": "painter", "prompt": "a cat", "n": 1,
                                                                        "response_format": "b64_json"}) as r:
                return r.status, r.headers.copy(), await r.json(), env.fake.requests

    status, headers, body, requests = run(go())
    assert status == 200, body
    assert [base64.b64decode(d["b64_json"]) for d in body["data"]] == PNG and isinstance(body["created"], int)
    assert headers["X-Mime-Types"] == "image/png,image/png" and headers["X-Request-Id"] == RID, dict(headers)
    assert requests[0].text == "a cat" and requests[0].model == "painter"


def test_chat_reads_the_text_output_and_final_usage():
    async def go():
        async with gateway() as env:
            async with env.client.post("/v1/chat/completions", json=CHAT) as r:
                one = await r.json()
            async with env.client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                events = sse_events(await r.read())
            return one, events

    one, events = run(go())
    assert one["choices"][0]["message"]["content"] == "Hello" and one["id"] == f"chatcmpl-{RID}"
    assert one["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "Hel"},
                                                          {"content": "lo"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("code, http_status", [(grpc.StatusCode.UNAVAILABLE, 503),
                                               (grpc.StatusCode.RESOURCE_EXHAUSTED, 429)])
def test_chat_errors_before_and_after_the_first_event(code, http_status):
    async def go():
        async with gateway() as env:
            env.fake.behavior.fail_code, env.fake.behavior.fail_message = code, "node group 'decoder' is gone"
            async with env.client.post("/v1/chat/completions", json=CHAT) as r:
                before = r.status, await r.json()
            env.fake.behavior.fail_after = 2
            async with env.client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                after = r.status, sse_events(await r.read())
            return before, after

    (status, body), (stream_status, events) = run(go())
    assert status == http_status and body["error"]["code"] == code.name and body["error"]["param"] is None
    assert stream_status == 200 and "[DONE]" not in events
    err = json.loads(events[-1])["error"]
    assert err["code"] == code.name and err["message"] == "node group 'decoder' is gone"


def test_invalid_kwarg_from_the_conductor_is_named_by_openai_param():
    async def go():
        async with gateway() as env:
            env.fake.behavior.fail_code = grpc.StatusCode.INVALID_ARGUMENT
            env.fake.behavior.fail_field, env.fake.behavior.fail_message = "model_kwargs.max_tokens", "too many"
            async with env.client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 9}) as r:
                return r.status, await r.json(), json.loads(env.fake.requests[0].model_kwargs_json)

    status, body, kwargs = run(go())
    assert kwargs == {"max_tokens": 9}
    assert status == 400 and body["error"]["param"] == body["error"]["field"] == "max_completion_tokens"
    assert body["error"]["message"] == "max_completion_tokens: model 'toy' rejected it: model_kwargs.max_tokens: too many"


def test_speech_wav_at_the_models_rate_and_pcm_cut_on_failure():  # wav is cut the same way (streamed)
    async def go():
        async with gateway() as env:
            async with env.client.post("/v1/audio/speech", json={"model": "toy", "input": "hi"}) as r:
                wav = r.status, r.headers["Content-Type"], await r.read()
            env.fake.behavior.fail_code, env.fake.behavior.fail_after = grpc.StatusCode.UNAVAILABLE, 3
            async with env.client.post("/v1/audio/speech", json={"model": "toy", "input": "hi",
                                                                  "response_format": "pcm"}) as r:
                assert r.status == 200 and r.headers["X-Sample-Rate-Hz"] == "24000"
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()  # the body is cut, visibly incomplete, not ended as if whole
            return wav

    status, content_type, data = run(go())
    assert status == 200 and content_type == "audio/wav"
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == 24000 and w.readframes(w.getnframes()) == AUDIO[0] + AUDIO[1]


def test_client_leaving_a_streaming_chat_cancels_the_call():
    async def go():
        async with gateway() as env:
            env.fake.behavior.hold_after = 2
            r = await env.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            await r.content.readuntil(b"\n\n")
            r.close()
            await asyncio.wait_for(env.fake.cancelled.wait(), WAIT_S)
            return env.fake.cancelled.is_set()

    assert run(go())


def test_speech_takes_the_sampling_knobs_at_top_level():
    """As the README lists them: temperature, top_p, seed, max_tokens go to the model as
    model_kwargs; one also given in model_kwargs is a 400 naming both."""
    async def go():
        async with gateway() as env:
            body = {"model": "toy", "input": "hi", "voice": "tara", "temperature": 0.7, "top_p": 0.9, "seed": 3,
                    "max_tokens": 50, "model_kwargs": {"repetition_penalty": 1.1}}
            async with env.client.post("/v1/audio/speech", json=body) as r:
                assert r.status == 200, await r.text()
            kwargs = json.loads(env.fake.requests[-1].model_kwargs_json)
            async with env.client.post("/v1/audio/speech", json={**body, "model_kwargs": {"temperature": 1}}) as r:
                clash = r.status, await r.json()
            return kwargs, clash

    kwargs, (status, err) = run(go())
    assert kwargs == {"voice": "tara", "temperature": 0.7, "top_p": 0.9, "seed": 3, "max_tokens": 50,
                      "repetition_penalty": 1.1}
    assert status == 400 and err["error"]["param"] == "model_kwargs.temperature"
    assert "also set by 'temperature'" in err["error"]["message"]


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_speech_streams_audio_as_it_is_made(fmt):
    """The first audio reaches the client while the conductor still holds the request (here: it
    sent two messages, then waits); wav starts with a streaming header of unknown length."""
    async def go():
        async with gateway() as env:
            env.fake.behavior.hold_after = 2  # the text chunk, then the first audio chunk; then nothing
            r = await env.client.post("/v1/audio/speech", json={"model": "toy", "input": "hi", "response_format": fmt})
            head = r.status, r.headers["Content-Type"], r.headers.get("Transfer-Encoding")
            want = (44 if fmt == "wav" else 0) + len(AUDIO[0])
            got = await asyncio.wait_for(r.content.readexactly(want), WAIT_S)
            held = not env.fake.cancelled.is_set()
            r.close()
            await asyncio.wait_for(env.fake.cancelled.wait(), WAIT_S)  # leaving cancels the call
            return head, got, held

    (status, content_type, encoding), got, held = run(go())
    assert status == 200 and content_type == f"audio/{fmt}" and encoding == "chunked" and held
    if fmt == "wav":
        assert got[:4] == b"RIFF" and got[4:8] == b"\xff\xff\xff\xff" and got[36:44] == b"data\xff\xff\xff\xff"
        with wave.open(io.BytesIO(got)) as w:  # a reader takes the unknown length as "to the end"
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
            assert w.readframes(w.getnframes()) == AUDIO[0]
    else:
        assert got == AUDIO[0]
