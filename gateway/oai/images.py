"""``POST /v1/images/generations``: OpenAI image generation for models with an image output.

No served model emits images yet, so for every model today this is the clear 400 naming
``model``. For one that does: ``prompt`` is the prompt text, each chunk of its image output
(the one named ``image``, else the first) is one ``data`` entry as ``b64_json``, in order.
``n`` must be 1 (or absent); ``response_format`` must be ``b64_json`` (M* keeps no image URLs);
``model_kwargs`` (M*'s extension) carries model-specific knobs such as a size.
"""

from __future__ import annotations

import base64
import time

from aiohttp import web

from mstar.gateway.body import read_json_object
from mstar.gateway.errors import ApiError
from mstar.gateway.generate import SETTINGS
from mstar.gateway.oai.call import conductor_call, openai_route, served_output
from mstar.gateway.oai.params import Known, Params, exactly, never

ROUTE = "/v1/images/generations"
_KNOBS = "pass model-specific knobs in model_kwargs"
KNOWN: dict[str, Known] = {
    "n": (exactly(1), "M* makes one request per call; leave n out or send 1"),
    "response_format": (exactly("b64_json"), "M* returns images inline; use b64_json"),
    "size": (never, _KNOBS), "quality": (never, _KNOBS), "style": (never, _KNOBS), "background": (never, _KNOBS),
    "output_format": (never, "the model decides the format (each entry's mime type is in X-Mime-Types)"),
    "output_compression": (never, _KNOBS), "moderation": (never, "M* does no moderation"),
    "partial_images": (never, "M* does not stream images"), "stream": (exactly(False), "M* does not stream images"),
    "user": (lambda v: isinstance(v, str), "must be a string"),
}


@openai_route
async def generate_images(request: web.Request) -> web.Response:
    p = Params(await read_json_object(request, request.app[SETTINGS].max_upload_bytes))
    model = p.string("model", required=True)
    prompt = p.string("prompt", required=True)
    p.extension_kwargs()
    p.finish(KNOWN, ROUTE)
    output = await served_output(request, model, "image", ROUTE)
    created = int(time.time())
    async with conductor_call(request, model, prompt, p, "prompt") as call:
        first = await call.next()
        if first is None:
            raise ApiError(500, "conductor ended the stream without a final event", code="INTERNAL")
        images = []
        async for msg in call.following(first):
            images.extend(c for c in msg.chunks if c.name == output)
    return web.json_response({"created": created, "data": [{"b64_json": base64.b64encode(c.data).decode("ascii")}
                                                           for c in images]},
                             headers={"X-Request-Id": first.request_id,
                                      "X-Mime-Types": ",".join(c.mime_type for c in images)})
