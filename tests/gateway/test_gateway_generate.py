"""POST /generate against a fake conductor: NDJSON streaming, aggregation, multipart, status mapping."""

import asyncio
import base64
import json
import os
import struct

import aiohttp
import grpc
import pytest
from gateway_harness import AUDIO, LATENT, RID, WAIT_S, assert_error, gateway, ndjson_lines, post_json, run


def test_streaming_ndjson_lines():
    async def go():
        async with gateway() as env:
            async with env.client.post("/generate", json={"model": "toy", "text": "hi", "stream": True}) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("application/x-ndjson")
                assert r.headers["X-Request-Id"] == RID
                lines = await ndjson_lines(r)
            return lines

    lines = run(go())
    assert [(x["type"], x.get("name"), x.get("index")) for x in lines] == [
        ("chunk", "text", 0), ("chunk", "audio", 0), ("chunk", "text", 1), ("chunk", "audio", 1),
        ("chunk", "latent", 0), ("final", None, None)]
    assert lines[0] == {"type": "chunk", "name": "text", "modality": "text", "index": 0, "text": "Hel",
                        "token_ids": [72, 101], "elapsed_s": 0.1}
    assert lines[1] == {"type": "chunk", "name": "audio", "modality": "audio", "index": 0,
                        "data_b64": base64.b64encode(AUDIO[0]).decode(), "mime_type": "audio/pcm",
                        "sample_rate_hz": 24000, "token_ids": [], "elapsed_s": 0.2}
    tensor = lines[4]["tensor"]
    assert lines[4]["modality"] == "latent" and tensor["datatype"] == "FP32" and tensor["shape"] == [2, 2]
    assert list(struct.unpack("<4f", base64.b64decode(tensor["data_b64"]))) == LATENT
    assert lines[5] == {"type": "final", "request_id": RID,
                        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "walks": 2, "audio_seconds": 0.5},
                        "timings": {"first_output_s": 0.1, "total_s": 0.6, "process_prompt_s": 0.01},
                        "finish_reason": "stop"}


def test_one_shot_aggregates_outputs():
    async def go():
        async with gateway() as env:
            return await post_json(env.client, {"model": "toy", "text": "hi"})

    status, body = run(go())
    assert status == 200, body
    assert body["request_id"] == RID and body["finish_reason"] == "stop"
    out = body["outputs"]
    assert out["text"] == {"modality": "text", "num_chunks": 2, "token_ids": [72, 101, 108], "text": "Hello"}
    assert out["audio"]["modality"] == "audio" and out["audio"]["sample_rate_hz"] == 24000
    assert base64.b64decode(out["audio"]["data_b64"]) == AUDIO[0] + AUDIO[1]
    assert out["audio"]["mime_type"] == "audio/pcm" and out["audio"]["num_chunks"] == 2
    [tensor] = out["latent"]["chunks"]
    assert list(struct.unpack("<4f", base64.b64decode(tensor["data_b64"]))) == LATENT
    assert body["usage"]["completion_tokens"] == 3 and body["timings"]["total_s"] == 0.6


@pytest.mark.parametrize("stream", [False, True])
def test_call_ends_ok_after_the_final_event_not_cancelled(stream):
    """The status follows the final event; the gateway waits for it rather than cancel a finished request."""
    async def go():
        async with gateway() as env:
            env.fake.behavior.linger_s = 0.2
            async with env.client.post("/generate", json={"model": "toy", "stream": stream}) as r:
                assert r.status == 200
                await r.read()
            return env.fake.ended.is_set(), env.fake.cancelled.is_set()

    assert run(go()) == (True, False)


def test_json_fields_reach_the_conductor_with_a_deadline():
    async def go():
        async with gateway(request_timeout_s=60) as env:
            status, _ = await post_json(env.client, {"model": "toy", "text": "héllo", "request_id": "abc",
                                                     "model_kwargs": {"max_tokens": 7, "voice": "tara"}, "timeout_s": 9.5})
            assert status == 200
            status, _ = await post_json(env.client, {"model": "toy"})  # no timeout_s: the gateway's limit bounds it
            assert status == 200
            return env.fake.requests, env.fake.deadlines

    (req, bare), (deadline, bare_deadline) = run(go())
    assert (req.model, req.text, req.request_id, req.timeout_s) == ("toy", "héllo", "abc", 9.5)
    assert json.loads(req.model_kwargs_json) == {"max_tokens": 7, "voice": "tara"}
    assert (bare.text, bare.model_kwargs_json, bare.timeout_s, bare.request_id) == ("", "", 0.0, "")
    assert 9.5 < deadline <= 12  # the request's own timeout plus the gateway's 2 s slack (gRPC rounds up)
    assert 60 < bare_deadline <= 62.5


def test_multipart_file_reaches_the_conductor_intact():
    payload = os.urandom(200_000) + b"\r\n--boundary\r\n\x00"

    async def go():
        async with gateway() as env:
            form = aiohttp.FormData()
            form.add_field("model", "toy")
            form.add_field("text", "describe")
            form.add_field("model_kwargs", json.dumps({"max_tokens": 3}))
            form.add_field("stream", "true")
            form.add_field("image", payload, filename="cat.png", content_type="image/png")
            form.add_field("clip", b"RIFF....", filename="a.wav", content_type="audio/wav")
            async with env.client.post("/generate", data=form) as r:
                assert r.status == 200, await r.text()
                lines = await ndjson_lines(r)
            return env.fake.requests, lines

    [req], lines = run(go())
    assert lines[-1]["type"] == "final"
    assert (req.model, req.text, json.loads(req.model_kwargs_json)) == ("toy", "describe", {"max_tokens": 3})
    assert [(f.name, f.content_type) for f in req.files] == [("image", "image/png"), ("clip", "audio/wav")]
    assert req.files[0].data == payload and req.files[1].data == b"RIFF...."


def test_error_after_streaming_began_is_the_last_line():
    async def go():
        async with gateway() as env:
            env.fake.behavior.fail_code = grpc.StatusCode.UNAVAILABLE
            env.fake.behavior.fail_message = "node group 'decoder' is unreachable"
            env.fake.behavior.fail_after = 2
            async with env.client.post("/generate", json={"model": "toy", "stream": True}) as r:
                assert r.status == 200
                lines = await ndjson_lines(r)
            status, body = await post_json(env.client, {"model": "toy"})
            return lines, status, body

    lines, status, body = run(go())
    assert [(x["type"], x.get("name")) for x in lines] == [("chunk", "text"), ("chunk", "audio"), ("chunk", "text"),
                                                           ("error", None)]
    assert lines[-1] == {"type": "error", "error": {"code": "UNAVAILABLE", "message": "node group 'decoder' is unreachable"}}
    assert_error(status, body, 503, None, "UNAVAILABLE")  # not streaming: nothing was sent yet
    assert "decoder" in body["error"]["message"]


@pytest.mark.parametrize("code,http_status,field", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "model_kwargs.max_tokens"),
    (grpc.StatusCode.NOT_FOUND, 404, "model"),
    (grpc.StatusCode.ALREADY_EXISTS, 409, None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, None),
    (grpc.StatusCode.CANCELLED, 499, None),
    (grpc.StatusCode.UNAVAILABLE, 503, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, None),
    (grpc.StatusCode.INTERNAL, 500, None),
    (grpc.StatusCode.FAILED_PRECONDITION, 500, None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_conductor_status_maps_to_http(code, http_status, field, stream):
    sent = "must be >= 1" if code == grpc.StatusCode.INVALID_ARGUMENT else f"the conductor says {code.name}"
    message = f"{field}: {sent}" if code == grpc.StatusCode.INVALID_ARGUMENT else sent  # as the conductor words it

    async def go():
        async with gateway() as env:
            env.fake.behavior.fail_code, env.fake.behavior.fail_message = code, sent
            async with env.client.post("/generate", json={"model": "toy", "stream": stream}) as r:
                return r.status, r.headers["Content-Type"], await r.json()

    status, content_type, body = run(go())
    assert content_type.startswith("application/json")
    assert_error(status, body, http_status, field, code.name)
    assert body["error"]["message"] == message


def test_client_disconnect_mid_stream_cancels_the_conductor_call():
    async def go():
        async with gateway() as env:
            env.fake.behavior.hold_after = 2
            r = await env.client.post("/generate", json={"model": "toy", "stream": True})
            first = json.loads(await asyncio_wait(r.content.readline()))
            assert first["type"] == "chunk"
            assert not env.fake.cancelled.is_set()
            r.close()  # drop the connection mid-stream
            await asyncio_wait(env.fake.cancelled.wait())
            await asyncio_wait(env.fake.ended.wait())

    run(go())


def test_client_disconnect_during_one_shot_cancels_the_conductor_call():
    async def go():
        async with gateway() as env:
            env.fake.behavior.hold_after = 1
            with pytest.raises(TimeoutError):
                await env.client.post("/generate", json={"model": "toy"}, timeout=aiohttp.ClientTimeout(total=0.5))
            await asyncio_wait(env.fake.cancelled.wait())

    run(go())


async def asyncio_wait(aw):
    return await asyncio.wait_for(aw, WAIT_S)
