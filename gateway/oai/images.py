"""``POST /v1/images/generations``: OpenAI image generation for models with an image output (BAGEL).

``prompt`` is the prompt text; each chunk of the model's image output (the one named ``image``,
else the first) is one ``data`` entry as ``b64_json`` (PNG), in order. The OpenAI parameters and
M*'s extensions become model kwargs, and the model checks their ranges (its refusal is a 400
naming the parameter sent):

- ``size``: ``"WIDTHxHEIGHT"`` -> ``width``, ``height`` (``"80x48"``: 80 wide, 48 high); ``"auto"``:
  the model's default;
- ``n`` -> ``n`` (sent when not 1): images from the same context, one ``data`` entry each;
- extensions: ``seed`` -> ``seed``, ``steps`` -> ``steps`` (flow timesteps), ``guidance`` ->
  ``cfg_text`` (the text guidance scale), and on edits ``image_guidance`` -> ``cfg_img``;
  ``model_kwargs`` adds model-specific knobs.

``response_format`` must be ``b64_json`` (M* keeps no image URLs); OpenAI's other knobs
(quality, style, background...) are a 400. ``/v1/images/edits`` (edits.py) shares this mapping.
"""

from __future__ import annotations

import base64
import time

from aiohttp import web

from mstar.gateway.errors import ApiError, bad_request
from mstar.gateway.oai.call import ConductorStream, conductor_call, openai_body, openai_route, served_output
from mstar.gateway.oai.media import parse_size
from mstar.gateway.oai.params import INTEGER, NUMBER, STRING, Known, Params, exactly, never
from mstar.v1 import conductor_pb2 as cpb

ROUTE = "/v1/images/generations"
_KNOBS = "pass model-specific knobs in model_kwargs"
KNOWN: dict[str, Known] = {
    "response_format": (exactly("b64_json"), "M* returns images inline; use b64_json"),
    "quality": (lambda v: v == "auto", _KNOBS), "style": (never, _KNOBS), "background": (lambda v: v == "auto", _KNOBS),
    "output_format": (exactly("png"), "the model's images are PNG"),
    "output_compression": (never, _KNOBS), "moderation": (never, "M* does no moderation"),
    "partial_images": (exactly(0), "M* does not stream images"), "stream": (exactly(False), "M* does not stream images"),
    "user": (lambda v: isinstance(v, str), "must be a string"),
}
#: M*'s extension parameters -> the model kwargs they set
EXTRAS = {"seed": ("seed", INTEGER), "steps": ("steps", INTEGER), "guidance": ("cfg_text", NUMBER)}


def image_knobs(p: Params, extras: dict = EXTRAS) -> None:
    """``size``, ``n`` and the extensions (EXTRAS) as model kwargs; ``model_kwargs`` after them."""
    size = p.take("size", STRING)
    if size is not None and (wh := parse_size(size)) is not None:
        p.set_kwarg("width", wh[0], "size")
        p.set_kwarg("height", wh[1], "size")
    n = p.take("n", INTEGER)
    if n is not None and n < 1:
        raise bad_request("n", f"n: must be at least 1, got {n}")
    if n is not None and n != 1:
        p.set_kwarg("n", n, "n")
    for name, (kwarg, kind) in extras.items():
        p.knob(name, kind, kwarg=kwarg)
    p.extension_kwargs()


async def images_response(call: ConductorStream, output: str, created: int) -> web.Response:
    first = await call.next()
    if first is None:
        raise ApiError(500, "conductor ended the stream without a final event", code="INTERNAL")
    images: list[cpb.OutputChunk] = []
    async for msg in call.following(first):
        images.extend(c for c in msg.chunks if c.name == output)
    return web.json_response({"created": created, "data": [{"b64_json": base64.b64encode(c.data).decode("ascii")}
                                                           for c in images]},
                             headers={"X-Request-Id": first.request_id,
                                      "X-Mime-Types": ",".join(c.mime_type for c in images)})


@openai_route
async def generate_images(request: web.Request) -> web.Response:
    p = Params(await openai_body(request, "images"))
    model = p.string("model", required=True)
    prompt = p.string("prompt", required=True)
    image_knobs(p)
    p.finish(KNOWN, ROUTE)
    output = await served_output(request, model, "image", ROUTE)
    async with conductor_call(request, model, prompt, p, "prompt") as call:
        return await images_response(call, output, int(time.time()))
