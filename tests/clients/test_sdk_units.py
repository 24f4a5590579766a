"""The SDK without a mesh: the chat-flattening rule, error typing, addresses, WAV writing, and the
REST transport against a scripted gateway."""

import asyncio
import base64
import json
import threading
import wave

import grpc
import pytest
from aiohttp import web

from mstar import (
    AlreadyExists,
    AsyncMStarClient,
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    MStarClient,
    MStarError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from mstar.client import Chunk, Final, Modality, Output, Result, Speech, Timings, Usage, prompt_from_messages
from mstar.client.errors import HTTP_STATUS, from_http, make_error
from mstar.gateway.errors import HTTP_FOR_GRPC


def test_last_user_message_is_the_prompt():
    assert prompt_from_messages([{"role": "system", "content": "be terse"}, {"role": "user", "content": "one"},
                                 {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]) == "three"
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    assert prompt_from_messages([{"role": "user", "content": parts, "name": "ann"}]) == "Hello"


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ("hi", "messages"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "messages[1].role"),
    ([{"role": "robot", "content": "a"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": ""}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "a", "tool_calls": []}], "messages[0].tool_calls"),
    (["hello"], "messages[0]"),
])
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(InvalidArgument) as e:
        prompt_from_messages(messages)
    assert e.value.field == field and e.value.status == 400 and e.value.message.startswith(field)


def test_sdk_and_gateway_map_grpc_codes_to_the_same_http_statuses():
    assert HTTP_STATUS == {code.name: status for code, status in HTTP_FOR_GRPC.items()}


@pytest.mark.parametrize("code, cls", [
    ("INVALID_ARGUMENT", InvalidArgument), ("NOT_FOUND", NotFound), ("ALREADY_EXISTS", AlreadyExists),
    ("RESOURCE_EXHAUSTED", ResourceExhausted), ("CANCELLED", Cancelled), ("UNAVAILABLE", Unavailable),
    ("DEADLINE_EXCEEDED", DeadlineExceeded),
])
def test_errors_are_typed_by_code(code, cls):
    e = make_error(code, "why", field="f")
    assert type(e) is cls and e.code == code and e.message == "why" and e.field == "f"
    assert e.status == HTTP_STATUS[code] == HTTP_FOR_GRPC[getattr(grpc.StatusCode, code)]


def test_http_error_bodies_become_typed_errors():
    e = from_http(400, {"error": {"message": "model_kwargs.x: no", "code": "INVALID_ARGUMENT", "field": "model_kwargs.x",
                                  "type": "invalid_request_error"}})
    assert isinstance(e, InvalidArgument) and e.field == "model_kwargs.x" and e.status == 400
    e = from_http(413, {"error": {"message": "too big", "code": "PAYLOAD_TOO_LARGE", "field": None}})
    assert isinstance(e, InvalidArgument) and e.code == "PAYLOAD_TOO_LARGE" and e.status == 413
    e = from_http(502, "<html>bad gateway</html>")  # a proxy's answer, not the gateway's
    assert type(e) is Unavailable and e.status == 502 and e.code == "BAD_GATEWAY" and "bad gateway" in e.message
    e = from_http(418, {"detail": "teapot"})
    assert type(e) is MStarError and e.status == 418 and e.code == "IM_A_TEAPOT"


@pytest.mark.parametrize("address", ["127.0.0.1:8000", "ftp://x", "grpc://", "grpc://host:1/path"])
def test_bad_addresses_are_refused(address):
    with pytest.raises(ValueError, match="address"):
        MStarClient(address)


def _speech(rates: list[int]) -> Speech:
    chunks = tuple(Chunk("audio", Modality.AUDIO, i, data=b"\x01\x00\x02\x00", sample_rate_hz=r)
                   for i, r in enumerate(rates))
    final = Final("r", Usage(), Timings(), "stop")
    return Speech(Output("audio", Modality.AUDIO, chunks), Result("r", chunks, final))


def test_to_wav_uses_the_chunks_rate(tmp_path):
    path = _speech([24000, 24000]).to_wav(tmp_path / "a.wav")
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (24000, 1, 2, 4)
        assert w.readframes(4) == b"\x01\x00\x02\x00" * 2
    with pytest.raises(ValueError, match="sample rate"):
        _speech([24000, 16000]).to_wav(tmp_path / "b.wav")


# --- REST transport against a scripted gateway: big NDJSON lines, an image model ----------------

IMAGE = bytes(range(256)) * 4096  # 1 MiB: one NDJSON line of ~1.4 MB, past aiohttp's 128 KiB readline limit


async def _fake_generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    assert body["stream"] is True and body["model"] == "painter"
    resp = web.StreamResponse(headers={"X-Request-Id": "big-1", "Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    line = json.dumps({"type": "chunk", "name": "image", "modality": "image", "index": 0, "mime_type": "image/png",
                       "data_b64": base64.b64encode(IMAGE).decode(), "token_ids": [], "elapsed_s": 0.1}).encode()
    for i in range(0, len(line), 50_000):  # arrives in pieces, as over a real network
        await resp.write(line[i:i + 50_000])
    await resp.write(b"\n" + json.dumps({
        "type": "final", "request_id": "big-1", "finish_reason": "stop",
        "usage": {"prompt_tokens": 1, "completion_tokens": 0, "walks": 1, "audio_seconds": 0.0},
        "timings": {"first_output_s": 0.1, "total_s": 0.2, "process_prompt_s": 0.0}}).encode() + b"\n")
    await resp.write_eof()
    return resp


async def _fake_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "painter", "object": "model", "owned_by": "mstar",
                                                          "walks": ["paint"], "outputs": ["image:image"],
                                                          "node_groups": ["all"]}]})


@pytest.fixture(scope="module")
def scripted_gateway():
    """A scripted gateway on its own thread and event loop, so the blocking client can call it too."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/generate", _fake_generate)
    app.router.add_get("/v1/models", _fake_models)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_big_lines_and_image_outputs_over_rest(scripted_gateway):
    with MStarClient(scripted_gateway, timeout=10) as client:
        [image] = client.generate_image("painter", "a cat")
        assert image.data == IMAGE and image.mime_type == "image/png"
        assert client.generate_image("a cat") == IMAGE  # the simple form: the served model's PNG bytes
        with pytest.raises(InvalidArgument) as e:
            client.tts("painter", "hi")
        assert e.value.field == "model" and "no audio output" in e.value.message

    async def go():
        async with AsyncMStarClient(scripted_gateway, timeout=10) as client:
            return await client.generate_image("painter", "a cat"), await client.generate_image("a cat")

    [image], png = asyncio.run(asyncio.wait_for(go(), 20))
    assert image.data == IMAGE and png == IMAGE


def test_the_model_defaults_only_when_the_server_serves_one():
    from mstar.client.base import default_model, split_model
    from mstar.client.types import ModelInfo

    one = [ModelInfo.parse("toy", ["w"], ["text:text"], ["g"])]
    assert default_model(one, "chat") == "toy"
    two = [*one, ModelInfo.parse("orpheus", ["w"], ["audio:audio"], ["g"])]
    with pytest.raises(InvalidArgument) as e:
        default_model(two, "chat")
    assert e.value.field == "model" and "serves 2 models (toy, orpheus)" in e.value.message and 'model="toy"' in e.value.message
    assert split_model(("toy", "hi"), None, "chat", "messages") == ("toy", "hi")
    assert split_model(("hi",), "toy", "chat", "messages") == ("toy", "hi")
    with pytest.raises(TypeError, match=r"chat\(\) takes \(messages\) or \(model, messages\)"):
        split_model((), None, "chat", "messages")
