"""/generate's binary answers against the fake conductor: which Accept asks for what, one tensor's raw
bytes, multipart parts for every chunk, and failures on both (a status before any byte, an error part
after the first)."""

import json
import struct

import aiohttp
import grpc
import pytest
from gateway_harness import AUDIO, LATENT, RID, gateway, run

from mstar.gateway.binary import MULTIPART, OCTET, accepted


@pytest.mark.parametrize("accept, want", [
    (None, None), ("*/*", None), ("application/json", None), ("application/x-ndjson, application/octet-stream", None),
    ("application/octet-stream", OCTET), ("text/html, Application/Octet-Stream; q=0.9", OCTET),
    ("multipart/mixed; boundary=x, application/json", MULTIPART)])
def test_the_first_served_type_in_accept_decides(accept, want):
    assert accepted(accept) == want


async def _post(client, accept: str, body: dict | None = None):
    async with client.post("/generate", json={"model": "toy", **(body or {})}, headers={"Accept": accept}) as r:
        if r.content_type != MULTIPART:
            return r.status, r.headers.copy(), await r.read()
        reader = aiohttp.MultipartReader.from_response(r)
        parts = []
        while (part := await reader.next()) is not None:
            parts.append((part.headers.copy(), await part.read()))
        return r.status, r.headers.copy(), parts


def test_octet_stream_is_the_tensors_bytes_with_its_headers():
    async def go():
        async with gateway() as env:
            return await _post(env.client, OCTET)
    status, headers, body = run(go())
    assert status == 200 and headers["X-Request-Id"] == RID
    assert (headers["X-Tensor-Name"], headers["X-Tensor-Datatype"], headers["X-Tensor-Shape"]) == ("latent", "FP32", "2,2")
    assert list(struct.unpack("<4f", body)) == LATENT


def test_multipart_carries_every_chunk_then_the_final_event():
    async def go():
        async with gateway() as env:
            return await _post(env.client, MULTIPART)
    status, headers, parts = run(go())
    assert status == 200 and headers["X-Request-Id"] == RID
    names = [(h["X-Chunk-Name"], h.get("X-Chunk-Index")) for h, _ in parts]
    assert names == [("text", "0"), ("audio", "0"), ("text", "1"), ("audio", "1"), ("latent", "0"), ("final", None)]
    (th, text), (ah, audio) = parts[0], parts[1]
    assert th["Content-Type"].startswith("text/plain") and text == b"Hel" and th["X-Token-Ids"] == "72,101"
    assert ah["Content-Type"] == "audio/pcm" and ah["X-Sample-Rate-Hz"] == "24000" and audio == AUDIO[0]
    lh, latent = parts[4]
    assert lh["X-Tensor-Shape"] == "2,2" and list(struct.unpack("<4f", latent)) == LATENT
    assert json.loads(parts[5][1])["usage"]["completion_tokens"] == 3


def test_failures_before_and_after_the_first_message():
    async def go():
        async with gateway() as env:
            env.fake.behavior.fail_code, env.fake.behavior.fail_after = grpc.StatusCode.UNAVAILABLE, 2
            octet = await _post(env.client, OCTET)
            parts = await _post(env.client, MULTIPART)
            env.fake.behavior.fail_after = 0
            first = await _post(env.client, MULTIPART)
            return octet, parts, first
    (status, _, body), (mstatus, _, parts), (fstatus, _, fbody) = run(go())
    assert status == 503 and json.loads(body)["error"]["code"] == "UNAVAILABLE"  # nothing sent yet: a status
    assert mstatus == 200 and [h["X-Chunk-Name"] for h, _ in parts] == ["text", "audio", "text", "error"]
    assert json.loads(parts[-1][1])["error"] == {"code": "UNAVAILABLE", "message": "boom"}
    assert fstatus == 503 and json.loads(fbody)["error"]["code"] == "UNAVAILABLE"


def test_several_tensor_outputs_need_output_and_output_needs_octet():
    async def go():
        async with gateway() as env:
            env.fake.models[0].outputs.append("frames:latent")
            return (await _post(env.client, OCTET, {"output": "text"}), await _post(env.client, "application/json",
                                                                                  {"output": "latent"}),
                    await _post(env.client, OCTET, {"output": "frames"}))
    (s1, _, b1), (s2, _, b2), (s3, _, b3) = run(go())
    e1, e2, e3 = (json.loads(b)["error"] for b in (b1, b2, b3))
    assert s1 == 400 and e1["field"] == "output" and "its tensor outputs: latent, frames" in e1["message"]
    assert s2 == 400 and e2["field"] == "output" and "application/octet-stream" in e2["message"]
    assert s3 == 400 and e3["field"] == "output" and "produced no 'frames'; it produced latent" in e3["message"]
