"""``POST /v1/images/edits``: OpenAI image editing (``multipart/form-data``) for models that
declare image edits in their ModelApi (BAGEL: ``mode: edit``).

Form fields: ``image`` (one PNG, JPEG or WebP file part; ``image[]`` is taken too, once),
``prompt``, ``model``, and as on /v1/images/generations (images.py) ``n``, ``size``,
``response_format`` (``b64_json``), ``user`` and M*'s ``seed``, ``steps``, ``guidance`` (->
``cfg_text``), ``image_guidance`` (-> ``cfg_img``) and ``model_kwargs`` (a JSON object). Numbers
arrive as form text and are read as JSON numbers. The model's edit kwargs go along
(``api.edit_kwargs_json``); a model without them is a 400 naming ``model``. BAGEL edits keep the
input image's size (fitted to its limits), so an explicit ``size`` is refused naming ``size``.
No ``mask``: a 400. An image that is not PNG/JPEG/WebP, or that the model cannot decode, is a
400 naming ``image``; one past the gateway's body limit a 413 naming it.
"""

from __future__ import annotations

import time

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from mstar.gateway.body import _read_part
from mstar.gateway.errors import ApiError, bad_request
from mstar.gateway.generate import SETTINGS
from mstar.gateway.json_body import read_json_field
from mstar.gateway.oai.call import api_kwargs, conductor_call, model_info, openai_route, served_output
from mstar.gateway.oai.images import EXTRAS, KNOWN, image_knobs, images_response
from mstar.gateway.oai.media import image_type
from mstar.gateway.oai.params import NUMBER, Params, never
from mstar.v1 import conductor_pb2 as cpb

ROUTE = "/v1/images/edits"
EDIT_EXTRAS = {**EXTRAS, "image_guidance": ("cfg_img", NUMBER)}
EDIT_KNOWN = {**KNOWN, "mask": (never, "the model edits the whole image; it takes no mask"),
              "input_fidelity": (never, "the model has no input fidelity setting")}
#: form fields read as JSON (numbers, the model_kwargs object); the rest stay strings
JSON_FIELDS = ("n", "seed", "steps", "guidance", "image_guidance", "partial_images", "output_compression", "model_kwargs",
               "stream")
IMAGE_FIELDS = ("image", "image[]")


async def _read_form(request: web.Request, max_bytes: int) -> tuple[dict, cpb.InputFile]:
    if request.content_type != "multipart/form-data":
        raise ApiError(415, f"unsupported Content-Type '{request.content_type}'; send multipart/form-data with the "
                            "image as a file part", code="UNSUPPORTED_MEDIA_TYPE")
    # no Content-Length check up front: reading part by part, the part that crosses the limit is named
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as e:
        raise bad_request(None, f"malformed multipart body: {e}") from None
    values: dict = {}
    image: cpb.InputFile | None = None
    total = 0
    while True:
        try:
            part = await reader.next()
        except (ValueError, AssertionError, HttpProcessingError) as e:
            raise bad_request(None, f"malformed multipart body: {e}") from None
        if part is None:
            break
        if not isinstance(part, BodyPartReader) or not part.name:
            raise bad_request(None, "every multipart part needs a name in its Content-Disposition")
        try:
            data, size = await _read_part(part, max_bytes - total, max_bytes)
        except ApiError as e:
            raise _too_large(max_bytes, part.name) if e.status == 413 else e from None
        total += size
        assert isinstance(data, bytes)
        if part.name in IMAGE_FIELDS:
            if image is not None:
                raise bad_request("image", "image: the model edits one image; send one")
            mime = image_type(data)
            if mime is None:
                raise bad_request("image", "image: not a PNG, JPEG or WebP image")
            image = cpb.InputFile(name="image", content_type=mime, data=data)
            continue
        if part.name in values:
            raise bad_request(part.name, f"{part.name}: sent more than once")
        values[part.name] = await _form_value(request, part.name, data)
    if image is None:
        raise bad_request("image", "image: required (a PNG, JPEG or WebP file part)")
    return values, image


def _too_large(limit: int, field: str | None = None) -> ApiError:
    where = f"{field}: " if field else ""
    return ApiError(413, f"{where}the body exceeds the gateway's limit of {limit} bytes ({limit / 2**20:g} MiB)",
                    code="PAYLOAD_TOO_LARGE", field=field)


async def _form_value(request: web.Request, name: str, data: bytes) -> object:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(name, f"{name}: not valid UTF-8") from None
    if name not in JSON_FIELDS:
        return text
    what = "a JSON object" if name == "model_kwargs" else "a number"
    return await read_json_field(request, name, data, request.app[SETTINGS].request_timeout_s, what)


@openai_route
async def edit_images(request: web.Request) -> web.Response:
    values, image = await _read_form(request, request.app[SETTINGS].max_upload_bytes)
    p = Params(values)
    model = p.string("model", required=True)
    prompt = p.string("prompt", required=True)
    image_knobs(p, EDIT_EXTRAS)
    p.finish(EDIT_KNOWN, ROUTE)
    info = await model_info(request, model)
    output = await served_output(request, model, "image", ROUTE, info)
    if not info.api.edit_kwargs_json:
        raise bad_request("model", f"model: model '{model}' does not edit images")
    p.route_kwargs(api_kwargs(info.api.edit_kwargs_json, "edit kwargs"), f"editing with model '{model}'")
    p.file_params, p.files_param = ["image"], "image"
    async with conductor_call(request, model, prompt, p, "prompt", [image]) as call:
        return await images_response(call, output, int(time.time()))
