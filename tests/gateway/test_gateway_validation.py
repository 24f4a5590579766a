"""Every bad request is answered with a JSON 4xx naming the field, and never reaches the conductor."""

import json
import logging

import aiohttp
import pytest
from gateway_harness import assert_error, gateway, post_json, run

from mstar.gateway.generate import CLIENT


def _json_case(body, **app_kw):
    async def go():
        async with gateway(**app_kw) as env:
            status, answer = await post_json(env.client, body)
            return status, answer, env.fake.requests

    return run(go())


@pytest.mark.parametrize("raw", [b'{"model": "toy",', b"not json", b"", b'{"model": "\xff\xfe"}'])
def test_malformed_json_is_400_without_a_field(raw):
    status, body, seen = _json_case(raw)
    assert_error(status, body, 400, None, "INVALID_ARGUMENT")
    assert "JSON" in body["error"]["message"] and seen == []


@pytest.mark.parametrize("raw", ['["toy"]', '"toy"', "null", "3"])
def test_body_must_be_an_object(raw):
    status, body, seen = _json_case(raw)
    assert_error(status, body, 400, None, "INVALID_ARGUMENT")
    assert "JSON object" in body["error"]["message"] and seen == []


@pytest.mark.parametrize("body,field", [
    ({"model": 3}, "model"),
    ({"model": ""}, "model"),
    ({"model": None}, "model"),
    ({"text": "hi"}, "model"),  # missing model
    ({"model": "toy", "text": 5}, "text"),
    ({"model": "toy", "text": None}, "text"),
    ({"model": "toy", "model_kwargs": "max_tokens=3"}, "model_kwargs"),
    ({"model": "toy", "model_kwargs": [1]}, "model_kwargs"),
    ({"model": "toy", "stream": "yes"}, "stream"),
    ({"model": "toy", "stream": 1}, "stream"),
    ({"model": "toy", "timeout_s": -1}, "timeout_s"),
    ({"model": "toy", "timeout_s": 0}, "timeout_s"),
    ({"model": "toy", "timeout_s": "5"}, "timeout_s"),
    ({"model": "toy", "timeout_s": True}, "timeout_s"),
    ({"model": "toy", "timeout_s": float("inf")}, "timeout_s"),
    ({"model": "toy", "timeout_s": float("nan")}, "timeout_s"),
    ({"model": "toy", "timeout_s": 301}, "timeout_s"),  # over the gateway's request_timeout_s
    ({"model": "toy", "request_id": 7}, "request_id"),
    ({"model": "toy", "prompt": "hi"}, "prompt"),  # unknown top-level key
])
def test_bad_fields_are_400_naming_the_field(body, field):
    status, answer, seen = _json_case(body)
    assert_error(status, answer, 400, field, "INVALID_ARGUMENT")
    assert field in answer["error"]["message"] and seen == []


def test_unknown_model_is_404_naming_model_and_listing_the_served():
    async def go():
        async with gateway() as env:
            status, body = await post_json(env.client, {"model": "bagle", "text": "hi"})
            ok, _ = await post_json(env.client, {"model": "toy"})
            ok2, _ = await post_json(env.client, {"model": "toy"})
            return status, body, ok, ok2, len(env.fake.requests), env.fake.list_calls

    status, body, ok, ok2, generates, list_calls = run(go())
    assert_error(status, body, 404, "model", "NOT_FOUND")
    assert "'bagle'" in body["error"]["message"] and "toy" in body["error"]["message"]
    assert (ok, ok2, generates) == (200, 200, 2)
    assert list_calls == 1  # the model list is cached, not fetched per request


def test_model_list_is_refreshed_on_a_miss():
    async def go():
        async with gateway() as env:
            env.client.app[CLIENT].models_min_refresh_s = 0.0
            assert (await post_json(env.client, {"model": "toy"}))[0] == 200
            env.fake.models[0].name = "orpheus"  # the conductor now serves a model the cache does not know
            status, _ = await post_json(env.client, {"model": "orpheus"})
            return status, env.fake.list_calls

    assert run(go()) == (200, 2)


def _oversized_cases():
    big = b"x" * 3000

    async def chunked():  # no Content-Length: aiohttp's client_max_size must catch it
        yield json.dumps({"model": "toy", "text": big.decode()}).encode()

    def multipart():
        form = aiohttp.FormData()
        form.add_field("model", "toy")
        form.add_field("image", big, filename="big.png", content_type="image/png")
        return form

    return {
        "json": lambda: (json.dumps({"model": "toy", "text": big.decode()}), {"Content-Type": "application/json"}),
        "json-chunked": lambda: (chunked(), {"Content-Type": "application/json"}),
        "multipart": lambda: (multipart(), None),
    }


@pytest.mark.parametrize("kind", ["json", "json-chunked", "multipart"])
def test_oversized_body_is_413_json(kind):
    async def go():
        async with gateway(max_upload_bytes=2048) as env:
            data, headers = _oversized_cases()[kind]()
            async with env.client.post("/generate", data=data, headers=headers) as r:
                return r.status, r.headers["Content-Type"], await r.json(), env.fake.requests

    status, content_type, body, seen = run(go())
    assert content_type.startswith("application/json")
    assert_error(status, body, 413, None, "PAYLOAD_TOO_LARGE")
    assert "2048 bytes" in body["error"]["message"] and seen == []


def test_multipart_chunked_over_the_limit_is_413():
    """A multipart body without Content-Length is counted as it is read."""
    async def go():
        async with gateway(max_upload_bytes=2048) as env:
            boundary = "b0undary"
            part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntoy\r\n"
                    f"--{boundary}\r\nContent-Disposition: form-data; name=\"f\"; filename=\"f.bin\"\r\n\r\n").encode()

            async def body():
                yield part
                yield b"y" * 4096
                yield f"\r\n--{boundary}--\r\n".encode()

            async with env.client.post("/generate", data=body(),
                                       headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}) as r:
                return r.status, await r.json()

    status, body = run(go())
    assert_error(status, body, 413, None, "PAYLOAD_TOO_LARGE")


def test_multipart_part_with_an_invalid_header_is_400():
    """A part header aiohttp cannot parse (here: a control byte in the name) is the client's
    malformed body, not a 500 (schemathesis found it)."""
    async def go():
        async with gateway() as env:
            boundary = "b0undary"
            body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"a\x08b\"\r\n\r\n{{}}\r\n"
                    f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntoy\r\n"
                    f"--{boundary}--\r\n").encode()
            async with env.client.post("/generate", data=body,
                                       headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}) as r:
                return r.status, await r.json(), env.fake.requests

    status, body, seen = run(go())
    assert_error(status, body, 400, None, "INVALID_ARGUMENT")
    assert "malformed multipart body" in body["error"]["message"] and seen == []


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_unsupported_content_type_is_415(content_type):
    async def go():
        async with gateway() as env:
            headers = {"Content-Type": content_type} if content_type else {}
            async with env.client.post("/generate", data=b'{"model": "toy"}', headers=headers,
                                       skip_auto_headers=["Content-Type"]) as r:
                return r.status, await r.json(), env.fake.requests

    status, body, seen = run(go())
    assert_error(status, body, 415, None, "UNSUPPORTED_MEDIA_TYPE")
    assert "application/json" in body["error"]["message"] and seen == []


@pytest.mark.parametrize("fields,field,words", [
    ([("model", "toy"), ("modle", "x")], "modle", "unknown form field"),
    ([("model", "toy"), ("model_kwargs", "{max_tokens: 3}")], "model_kwargs", "not valid JSON"),
    ([("model", "toy"), ("model_kwargs", "[3]")], "model_kwargs", "object"),
    ([("model", "toy"), ("stream", "maybe")], "stream", "'true' or 'false'"),
    ([("model", "toy"), ("timeout_s", "soon")], "timeout_s", "number"),
    ([("model", "toy"), ("model", "toy")], "model", "more than once"),
    ([("text", "hi")], "model", "required"),
])
def test_bad_multipart_fields_are_400(fields, field, words):
    async def go():
        async with gateway() as env:
            form = aiohttp.FormData()
            for name, value in fields:
                form.add_field(name, value)
            form.add_field("image", b"\x89PNG", filename="x.png", content_type="image/png")
            async with env.client.post("/generate", data=form) as r:
                return r.status, await r.json(), env.fake.requests

    status, body, seen = run(go())
    assert_error(status, body, 400, field, "INVALID_ARGUMENT")
    assert words in body["error"]["message"] and seen == []


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/nope", 404, "NOT_FOUND"),
    ("GET", "/generate", 405, "METHOD_NOT_ALLOWED"),
    ("DELETE", "/v1/models", 405, "METHOD_NOT_ALLOWED"),
])
def test_http_errors_are_json(method, path, status, code):
    async def go():
        async with gateway() as env:
            async with env.client.request(method, path) as r:
                return r.status, r.headers["Content-Type"], await r.json()

    got, content_type, body = run(go())
    assert content_type.startswith("application/json")
    assert_error(got, body, status, None, code)
    assert path in body["error"]["message"]


def test_unexpected_exception_is_a_json_500_and_logged(caplog):
    async def go():
        async with gateway() as env:
            async def broken(*a, **kw):
                raise RuntimeError("wires crossed")

            env.client.app[CLIENT].find_model = broken
            async with env.client.post("/generate", json={"model": "toy"}) as r:
                return r.status, r.headers["Content-Type"], await r.json()

    with caplog.at_level(logging.ERROR, logger="mstar.gateway"):
        status, content_type, body = run(go())
    assert content_type.startswith("application/json")
    assert_error(status, body, 500, None, "INTERNAL")
    assert any("wires crossed" in (r.exc_text or "") for r in caplog.records)
