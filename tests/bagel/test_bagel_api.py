"""BAGEL's public API on one served mesh (in-process, real gRPC, the tiny random checkpoint, the real
gateway app on a loopback port): /v1/images/generations (a non-square ``size``), /v1/images/edits
(multipart) and /v1/chat/completions with an image (streamed and not) give what the reference gave
and what native /generate gives for the same request and seed; the SDK's generate_image, edit_image
and chat(images=...) (sync and asyncio) too; bad sizes, steps, batches and images are 4xx naming the
field sent."""

import asyncio
import base64
import json
import urllib.request

import pytest
from served_gateway import ServedGateway, sse_events
from test_bagel_mesh import mesh_config, pixels, png
from test_bagel_reference import scenario_image

from mstar.client import AsyncMStarClient, InvalidArgument, MStarClient

MAX_UPLOAD = 2 << 20


@pytest.fixture(scope="module")
def gw(bagel_cache, reference):
    with ServedGateway(mesh_config("default", reference[1]), bagel_cache, max_upload_bytes=MAX_UPLOAD) as g:
        yield g


def scenario(reference, name):
    return reference[1]["scenarios"][name]


def input_png(reference, name) -> bytes:
    return png(scenario_image(scenario(reference, name)["image"]))


def near_reference(data: bytes, reference, name):
    diff = (pixels(data).int() - reference[0][f"{name}.pixels"].int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (name, diff.max())


def native(gw, text, model_kwargs, files=()):
    """POST /generate (multipart when there are files): its collected outputs."""
    if files:
        fields = {"model": "bagel", "text": text, "model_kwargs": json.dumps(model_kwargs)}
        status, body = gw.post_form("/generate", fields, {n: (n + ".png", d, "image/png") for n, d in files})
    else:
        status, body = gw.post_json("/generate", {"model": "bagel", "text": text, "model_kwargs": model_kwargs})
    assert status == 200, body
    return body["outputs"]


def t2i_request(reference):
    s = scenario(reference, "t2i")
    h, w = s["kw"]["image_shapes"]
    assert h != w  # the order matters: OpenAI's size is WIDTHxHEIGHT
    return s, {"model": "bagel", "prompt": s["prompt"], "size": f"{w}x{h}", "seed": s["seed"],
               "steps": s["kw"]["num_timesteps"], "guidance": s["kw"]["cfg_text_scale"], "response_format": "b64_json"}


def test_generations_map_size_seed_steps_guidance(gw, reference):
    s, body = t2i_request(reference)
    status, out = gw.post_json("/v1/images/generations", body)
    assert status == 200, out
    (entry,) = out["data"]
    image = base64.b64decode(entry["b64_json"])
    h, w = s["kw"]["image_shapes"]
    assert tuple(pixels(image).shape) == (h, w, 3)
    near_reference(image, reference, "t2i")
    same = native(gw, s["prompt"], {"height": h, "width": w, "seed": s["seed"], "steps": s["kw"]["num_timesteps"],
                                    "cfg_text": s["kw"]["cfg_text_scale"]})
    assert base64.b64decode(same["image"]["data_b64"]) == image  # the same request through /generate


def test_generations_n_gives_one_entry_per_image(gw, reference):
    _, body = t2i_request(reference)
    status, out = gw.post_json("/v1/images/generations", {**body, "n": 2, "steps": 3})
    assert status == 200, out
    images = [base64.b64decode(d["b64_json"]) for d in out["data"]]
    assert len(images) == 2 and images[0] != images[1]  # seed, seed + 1


def test_edits_take_a_multipart_image(gw, reference):
    s = scenario(reference, "edit")
    k = s["kw"]
    fields = {"model": "bagel", "prompt": s["prompt"], "seed": str(s["seed"]), "steps": str(k["num_timesteps"]),
              "guidance": str(k["cfg_text_scale"]), "image_guidance": str(k["cfg_img_scale"]), "n": "1",
              "response_format": "b64_json"}
    status, out = gw.post_form("/v1/images/edits", fields, {"image": ("in.png", input_png(reference, "edit"), "image/png")})
    assert status == 200, out
    image = base64.b64decode(out["data"][0]["b64_json"])
    near_reference(image, reference, "edit")
    same = native(gw, s["prompt"], {"mode": "edit", "seed": s["seed"], "steps": k["num_timesteps"],
                                    "cfg_text": k["cfg_text_scale"], "cfg_img": k["cfg_img_scale"]},
                  [("image", input_png(reference, "edit"))])
    assert base64.b64decode(same["image"]["data_b64"]) == image


def image_chat(reference, stream=False):
    s = scenario(reference, "understand")
    url = "data:image/png;base64," + base64.b64encode(input_png(reference, "understand")).decode()
    return s, {"model": "bagel", "stream": stream, "max_tokens": s["kw"]["max_think_token_n"] - 1, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": s["prompt"]}]}]}


def test_chat_with_an_image_streams_the_reference_answer(gw, reference):
    s, body = image_chat(reference)
    status, out = gw.post_json("/v1/chat/completions", body)
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == s["text"]
    status, raw = gw.post_json("/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]]
    assert len([d for d in deltas if d]) > 1 and "".join(deltas) == s["text"]  # streamed, token by token
    same = native(gw, s["prompt"], {"mode": "understand", "max_tokens": body["max_tokens"]},
                  [("image", input_png(reference, "understand"))])
    assert same["text"]["text"] == s["text"]


def test_sdk_generate_edit_and_chat_with_images(gw, reference):
    s, body = t2i_request(reference)
    h, w = s["kw"]["image_shapes"]
    knobs = dict(height=h, width=w, seed=s["seed"], steps=s["kw"]["num_timesteps"], cfg_text=s["kw"]["cfg_text_scale"])
    e = scenario(reference, "edit")
    edit = dict(seed=e["seed"], steps=e["kw"]["num_timesteps"])
    u = scenario(reference, "understand")
    with MStarClient(gw.url, timeout=120) as client:
        assert client.models()[0].api.edit_kwargs == {"mode": "edit"}
        near_reference(client.generate_image(s["prompt"], **knobs), reference, "t2i")
        near_reference(client.edit_image(e["prompt"], image=input_png(reference, "edit"), **edit), reference, "edit")
        answer = client.chat(u["prompt"], images=[input_png(reference, "understand")], max_tokens=11)
        assert answer.text == u["text"]
        stream = client.chat(u["prompt"], images=[input_png(reference, "understand")], max_tokens=11, stream=True)
        assert "".join(c.text for c in stream) == u["text"]

    async def go():
        async with AsyncMStarClient(gw.url, timeout=120) as client:
            edited = await client.edit_image("bagel", e["prompt"], image=input_png(reference, "edit"), **edit)
            answer = await client.chat(u["prompt"], images=[input_png(reference, "understand")], max_tokens=11)
            with pytest.raises(InvalidArgument) as err:
                await client.chat("hi", audios=[b"RIFF"])
            return edited, answer, err.value

    edited, answer, err = asyncio.run(asyncio.wait_for(go(), 240))
    near_reference(edited[0].data, reference, "edit")
    assert answer.text == u["text"] and err.field == "audios[0]"


BAD_GENERATIONS = [
    ({"size": "2048x1024"}, "size"), ({"size": "big"}, "size"), ({"size": "72x48"}, "size"),  # not a multiple of 16
    ({"steps": 101}, "steps"), ({"steps": 1}, "steps"), ({"n": 9}, "n"), ({"n": 0}, "n"),
    ({"guidance": "high"}, "guidance"), ({"response_format": "url"}, "response_format"), ({"quality": "hd"}, "quality"),
]


@pytest.mark.parametrize("extra, field", BAD_GENERATIONS)
def test_bad_generations_name_the_field(gw, extra, field):
    status, out = gw.post_json("/v1/images/generations", {"model": "bagel", "prompt": "a cat", **extra})
    assert status == 400 and out["error"]["param"] == field, out
    assert out["error"]["message"].startswith(field), out


def _broken_png(reference) -> bytes:
    data = input_png(reference, "edit")
    return data[:40]  # the PNG signature and a cut header: sniffed as PNG, not decodable


@pytest.mark.parametrize("case", ["not_an_image", "undecodable", "no_image", "size", "mask", "two_images", "too_large",
                                  "bad_number", "mode_twice"])
def test_bad_edits_name_the_field(gw, reference, case):
    good = ("in.png", input_png(reference, "edit"), "image/png")
    fields, files, field, status_want = {"model": "bagel", "prompt": "make it blue"}, {"image": good}, "image", 400
    if case == "not_an_image":
        files = {"image": ("in.png", b"hello, world", "image/png")}
    elif case == "undecodable":
        files = {"image": ("in.png", _broken_png(reference), "image/png")}
    elif case == "no_image":
        files = {}
    elif case == "size":
        fields["size"], field = "64x48", "size"
    elif case == "mask":
        files["mask"], field = good, "mask"
    elif case == "two_images":
        files["image[]"] = good
    elif case == "too_large":
        files = {"image": ("in.png", b"\x89PNG\r\n\x1a\n" + bytes(MAX_UPLOAD), "image/png")}
        status_want = 413
    elif case == "bad_number":
        fields["steps"], field = "ten", "steps"
    elif case == "mode_twice":
        fields["model_kwargs"], field = json.dumps({"mode": "understand"}), "model_kwargs.mode"
    status, out = gw.post_form("/v1/images/edits", fields, files)
    assert status == status_want and out["error"]["param"] == field, (case, out)
    assert out["error"]["message"].startswith(field), out


def _chat(content, **kw):
    return {"model": "bagel", "max_tokens": 2, "messages": [{"role": "user", "content": content}], **kw}


def _img(url):
    return [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]


BAD_CHATS = [
    (_chat(_img("https://example.com/cat.png")), "messages[0].content[1].image_url.url"),
    (_chat(_img("data:image/png;base64,%%%")), "messages[0].content[1].image_url.url"),
    (_chat(_img("data:text/plain;base64,aGk=")), "messages[0].content[1].image_url.url"),
    (_chat(_img("data:image/png;base64," + base64.b64encode(b"not a png at all").decode())), "messages[0].content[1]"),
    (_chat([{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]), "messages[0].content[0]"),
    (_chat("hi", modalities=["text", "audio"]), "modalities"),
    (_chat("hi", audio={"voice": "ethan", "format": "wav"}), "audio"),
    (_chat("hi", model_kwargs={"mode": "edit"}), "model_kwargs.mode"),
]


@pytest.mark.parametrize("body, field", BAD_CHATS)
def test_bad_chats_name_the_field(gw, body, field):
    status, out = gw.post_json("/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == field, out
    assert out["error"]["message"].startswith(field), out


def test_text_only_chat_is_understanding_without_an_image(gw):
    status, out = gw.post_json("/v1/chat/completions", _chat("Hello", max_tokens=3))
    assert status == 200, out
    assert out["usage"]["completion_tokens"] >= 1
    assert out["choices"][0]["message"]["content"] == native(gw, "Hello", {"mode": "understand", "max_tokens": 3})["text"]["text"]


def test_models_show_the_api(gw):
    with urllib.request.urlopen(gw.url + "/v1/models", timeout=10) as r:
        (m,) = json.loads(r.read())["data"]
    assert m["api"]["chat_media"] == ["image"] and m["api"]["edit_kwargs"] == {"mode": "edit"}
    assert m["api"]["chat_kwargs"] == {"mode": "understand"} and m["api"]["chat_audio_output"] is None
