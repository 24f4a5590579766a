"""Issue 49, hole 1: a JSON body's request-sized costs are bounded before they are paid (mstar/limits.py),
each refused with a 400 naming the field, on every JSON route and form field, whether the body is
parsed on the loop or (past INLINE_JSON_BYTES) in a worker process. Hole 7: a ``timeout_s`` below
MIN_TIMEOUT_S is a 400 naming it, not a 504. The bodies that must still pass pass."""

import base64
import json

import aiohttp
from gateway_harness import assert_error, gateway, run

from mstar.limits import (
    INLINE_JSON_BYTES,
    MAX_CHAT_MESSAGES,
    MAX_CONTENT_PARTS,
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
    MAX_TEXT_CHARS,
)

JSON = {"Content-Type": "application/json"}


def _msg(content, role="user"):
    return {"role": role, "content": content}


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


#: (route, body, the field the 400 names); each body is refused by one bound, on the loop or in a worker
CASES = [
    ("/v1/chat/completions", {"model": "toy", "messages": [_msg("a")] * (MAX_CHAT_MESSAGES + 1)}, "messages"),
    ("/v1/chat/completions", {"model": "toy", "messages": [_msg("x" * 40)] * (MAX_CHAT_MESSAGES + 1)}, "messages"),
    ("/v1/chat/completions", {"model": "toy", "messages": [_msg([{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1))]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "toy", "messages": [_msg("a" * (MAX_TEXT_CHARS // 2), "system"),
                                                           _msg("b" * (MAX_TEXT_CHARS // 2 + 1))]},
     "messages[1].content"),
    ("/v1/chat/completions", {"model": "toy", "messages": [_msg("a")] * 900_000}, "messages"),  # the body
    ("/v1/chat/completions", {"model": "toy", "messages": [_msg("hi")], "metadata": {"ids": [0] * MAX_JSON_VALUES}},
     "metadata"),
    ("/generate", {"model": "toy", "model_kwargs": {"ids": [[]] * MAX_JSON_VALUES}}, "model_kwargs"),
    ("/generate", {"model": "toy", "text": "t" * (MAX_TEXT_CHARS + 1)}, "text"),
    ("/generate", {"model": "toy", "model_kwargs": _nested(MAX_JSON_DEPTH + 1), "text": "x" * INLINE_JSON_BYTES},
     "model_kwargs" + ".a" * (MAX_JSON_DEPTH - 1)),
    ("/v1/audio/speech", {"model": "toy", "input": "s" * (MAX_TEXT_CHARS + 1)}, "input"),
    ("/v1/images/generations", {"model": "toy", "prompt": "p" * (MAX_TEXT_CHARS + 1)}, "prompt"),
]


def test_a_body_past_each_bound_is_a_400_naming_the_field():
    async def go():
        async with gateway() as env:
            answers = []
            for route, body, _ in CASES:
                async with env.client.post(route, data=json.dumps(body), headers=JSON) as r:
                    answers.append((r.status, await r.json()))
            return answers, len(env.fake.requests)

    answers, reached_conductor = run(go(), 120)
    for (route, _, field), (status, body) in zip(CASES, answers, strict=True):
        assert status == 400, (route, field, status, body)
        assert body["error"]["field"] == field and body["error"]["code"] == "INVALID_ARGUMENT", (route, body)
        assert field.split(".")[0] in body["error"]["message"], body
    assert reached_conductor == 0


def test_the_largest_real_bodies_still_pass():
    """At the bounds, and a chat with a large base64 image (parsed and decoded in a worker); what
    reaches the fake conductor stays under its 4 MiB message limit."""
    png = b"\x89PNG\r\n\x1a\n" + bytes(2 << 20)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
    bodies = [
        ("/v1/chat/completions", {"model": "toy", "messages": [_msg("hello")] * MAX_CHAT_MESSAGES}),
        ("/v1/chat/completions", {"model": "toy", "messages": [_msg([{"type": "text", "text": "a"}] * MAX_CONTENT_PARTS)]}),
        ("/v1/chat/completions", {"model": "toy", "messages": [_msg("t" * (MAX_TEXT_CHARS - 2), "system"), _msg("hi")]}),
        ("/generate", {"model": "toy", "model_kwargs": {"target_ids": list(range(8192)),
                                                        "context_ids": list(range(8192, 16384))}}),
        ("/v1/chat/completions", {"model": "toy", "messages": [_msg([{"type": "text", "text": "what is this?"}, image])]}),
    ]

    async def go():
        async with gateway() as env:
            env.fake.models[0].api.chat_media.append("image")
            out = []
            for route, body in bodies:
                async with env.client.post(route, data=json.dumps(body), headers=JSON) as r:
                    out.append((r.status, await r.read()))
            return out, env.fake.requests

    out, requests = run(go(), 120)
    assert [s for s, _ in out] == [200] * len(bodies), [b[:300] for _, b in out]
    last = requests[-1]
    assert [f.data for f in last.files] == [png] and last.text == "what is this?"
    assert json.loads(requests[3].model_kwargs_json)["context_ids"][-1] == 16383


def test_a_large_json_form_field_is_bounded_too():
    async def go():
        async with gateway() as env:
            form = aiohttp.FormData(default_to_multipart=True)
            form.add_field("model", "toy")
            form.add_field("model_kwargs", json.dumps({"ids": [0] * MAX_JSON_VALUES}))
            async with env.client.post("/generate", data=form) as r:
                return r.status, await r.json(), len(env.fake.requests)

    status, body, reached = run(go(), 60)
    assert_error(status, body, 400, "model_kwargs.ids", "INVALID_ARGUMENT")
    assert "65536" in body["error"]["message"] and reached == 0


def test_a_timeout_below_the_smallest_is_a_400_naming_timeout_s():
    async def go():
        async with gateway() as env:
            out = []
            for value in (5e-324, 0.0009):
                async with env.client.post("/generate", data=json.dumps({"model": "toy", "timeout_s": value}),
                                           headers=JSON) as r:
                    out.append((r.status, await r.json()))
            form = aiohttp.FormData(default_to_multipart=True)
            form.add_field("model", "toy")
            form.add_field("timeout_s", "5e-324")
            async with env.client.post("/generate", data=form) as r:
                out.append((r.status, await r.json()))
            async with env.client.post("/generate", data=json.dumps({"model": "toy", "timeout_s": 0.001}),
                                       headers=JSON) as r:
                ok = r.status
            return out, ok, len(env.fake.requests)

    out, ok, reached = run(go())
    for status, body in out:
        assert_error(status, body, 400, "timeout_s", "INVALID_ARGUMENT")
        assert "0.001 s" in body["error"]["message"]
    assert ok == 200 and reached == 1  # the smallest allowed timeout is taken
