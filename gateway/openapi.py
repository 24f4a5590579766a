"""The gateway's OpenAPI 3.1 document, served at ``GET /openapi.json``.

Hand-written from the handlers (body.py, generate.py, oai/): request schemas are exactly as
strict as the validation, so a body the schema refuses is refused with a 4xx, and every
response shape, errors included, is here. tests/clients/test_openapi.py checks live answers
against it with schemathesis.
"""

from __future__ import annotations

from aiohttp import web

from mstar.gateway.generate import GatewaySettings

REF = "#/components/schemas/"


def _ref(name: str) -> dict:
    return {"$ref": REF + name}


def _or_null(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _obj(props: dict, required: tuple[str, ...] = (), *, closed: bool = True, doc: str = "") -> dict:
    out: dict = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    if doc:
        out["description"] = doc
    return out


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
MODEL = {"type": "string", "minLength": 1, "description": "a served model's name", "examples": ["toy"]}
OUTPUT = {"type": "string", "description": "with Accept: application/octet-stream: the tensor output to answer "
                                          "(e.g. 'frames' of a rollout); empty: the result's only one"}
TENSOR_HEADERS = {f"X-Tensor-{h}": {"schema": STR, "description": d} for h, d in (
    ("Name", "application/octet-stream: the output's name"), ("Datatype", "FP32, INT64, ... (tensor.proto)"),
    ("Shape", "comma-separated sizes, e.g. 50,32 (empty: a scalar)"))}
KWARGS = {"type": "object", "description": "per-request knobs; each model validates its own keys: see the "
                                          "<Model>ModelKwargs schemas (from the models' typed knobs)",
          "examples": [{"max_tokens": 8}]}
_ERRORS = {
    "400": "a request field is wrong (``field``/``param`` names it)",
    "404": "unknown model, or no such route",
    "405": "wrong method for the route",
    "409": "request_id already in flight",
    "413": "body larger than the gateway's limit",
    "406": "Accept: application/octet-stream for an output that came in chunks of different shapes",
    "415": "unsupported Content-Type",
    "429": "admission limit reached, or the caller's large JSON bodies already queued (Retry-After)",
    "499": "cancelled before it finished",
    "500": "internal error",
    "503": "the conductor or a service behind it is unavailable, or the gateway's JSON worker failed",
    "504": "the request ran past its timeout",
}


def _errors(*codes: str) -> dict:
    codes = codes or tuple(_ERRORS)
    return {c: {"description": _ERRORS[c], "content": {"application/json": {"schema": _ref("Error")}}} for c in codes}


def _sse(*schema_names: str, done: bool = False) -> dict:
    """An event stream, described event by event (schemathesis reads ``schema`` of text/event-stream
    so before OpenAPI 3.2's ``itemSchema``): each ``data`` is one of the named JSON objects, or
    the closing ``[DONE]``."""
    data: dict = {"contentMediaType": "application/json",
                  "contentSchema": {"anyOf": [_ref(n) for n in (*schema_names, "Error")]}}
    if done:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    return {"text/event-stream": {"schema": _obj({"event": {"const": "message"}, "data": data, "id": STR,
                                                   "retry": INT}, ("data",))}}


def _json_body(schema_name: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": _ref(schema_name)}}}


def model_kwargs_schemas() -> dict:
    """Each registered model's request knobs, as its typed schema says (models/*/knobs.py):
    ``OrpheusModelKwargs``... Documentation of ``model_kwargs``: a body names its model at run
    time, so the request schemas keep ``model_kwargs`` an open object."""
    from mstar.models.registry import request_schemas

    return {f"{name.title().replace('_', '')}ModelKwargs": cls.json_schema() for name, cls in request_schemas().items()}


def _schemas(max_timeout_s: float) -> dict:
    chunk_line = _obj({
        "type": {"const": "chunk"}, "name": STR,
        "modality": {"enum": ["unspecified", "text", "image", "audio", "action", "latent"]},
        "index": INT, "text": STR, "data_b64": {"type": "string", "contentEncoding": "base64"},
        "mime_type": STR, "sample_rate_hz": INT, "tensor": _ref("Tensor"),
        "token_ids": {"type": "array", "items": INT}, "elapsed_s": NUM,
    }, ("type", "name", "modality", "index", "token_ids", "elapsed_s"))
    usage = _obj({"prompt_tokens": INT, "completion_tokens": INT, "walks": INT, "audio_seconds": NUM},
                 ("prompt_tokens", "completion_tokens", "walks", "audio_seconds"))
    timings = _obj({"first_output_s": NUM, "total_s": NUM, "process_prompt_s": NUM},
                   ("first_output_s", "total_s", "process_prompt_s"))
    text_part = _obj({"type": {"const": "text"}, "text": STR}, ("type", "text"), closed=False)
    data_url = {"type": "string", "pattern": "^data:", "description": "an inline data: URL "
                "(data:<type>;base64,...); M* fetches no remote media"}
    url_part = lambda kind: _obj({"type": {"const": f"{kind}_url"}, f"{kind}_url": _obj(  # noqa: E731
        {"url": data_url, "detail": _or_null({"enum": ["auto", "low", "high"]})}, ("url",))}, ("type", f"{kind}_url"))
    audio_part = _obj({"type": {"const": "input_audio"}, "input_audio": _obj(
        {"data": {"type": "string", "contentEncoding": "base64"}, "format": {"enum": ["wav", "mp3"]}},
        ("data", "format"))}, ("type", "input_audio"))
    message = _obj({
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [STR, {"type": "array", "items": {"anyOf": [text_part, url_part("image"), audio_part,
                                                                        url_part("video")]}}, {"type": "null"}]},
        "name": _or_null(STR),
    }, ("role",), doc="The last message must be a user message: its text is the prompt and its media parts "
                      "(image_url, input_audio, video_url: M*'s, shaped like image_url) its files, for the media "
                      "kinds the model's api.chat_media lists; earlier messages are checked, not sent "
                      "(mstar/client/messages.py).")
    chat_audio = _obj({"id": STR, "data": {"type": "string", "contentEncoding": "base64"}, "expires_at": INT,
                       "transcript": STR}, doc="modalities [text, audio]: the spoken answer (WAV, or PCM16 24 kHz mono) "
                                              "and its transcript; M* keeps no audio, expires_at is the creation time")
    model_api = _obj({
        "chat_media": {"type": "array", "items": {"enum": ["image", "audio", "video"]}},
        "chat_kwargs": {"type": "object"}, "chat_audio_output": _or_null(STR),
        "voices": {"type": "array", "items": STR}, "default_voice": _or_null(STR),
        "audio_formats": {"type": "array", "items": {"enum": ["wav", "pcm16"]}},
        "edit_kwargs": _or_null({"type": "object"}),
    }, ("chat_media", "chat_kwargs", "chat_audio_output", "voices", "default_voice", "audio_formats", "edit_kwargs"),
        doc="What the OpenAI routes may send to and ask of the model (conductor.proto ModelApi)")
    size = {"type": "string", "pattern": "^(auto|[1-9][0-9]{0,4}x[1-9][0-9]{0,4})$",
            "description": "WIDTHxHEIGHT in pixels (model_kwargs width, height), or auto", "examples": ["1024x768"]}
    image_knobs = {"size": _or_null(size), "n": _or_null({"type": "integer", "minimum": 1}),
                   "seed": _or_null(INT), "steps": _or_null(INT), "guidance": _or_null(NUM),
                   "response_format": _or_null({"const": "b64_json"}), "user": _or_null(STR),
                   "quality": _or_null({"const": "auto"}), "background": _or_null({"const": "auto"}),
                   "output_format": _or_null({"const": "png"}), "partial_images": _or_null({"const": 0}),
                   "stream": _or_null({"const": False})}
    oai_usage = _obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT},
                     ("prompt_tokens", "completion_tokens", "total_tokens"))
    return {
        **model_kwargs_schemas(),
        "Error": _obj({"error": _obj({
            "message": STR, "type": {"enum": ["invalid_request_error", "rate_limit_error", "server_error"]},
            "field": _or_null(STR), "param": _or_null(STR), "code": STR,
        }, ("message", "type", "field", "code"))}, ("error",),
            doc="Every error. ``code``: the gRPC status name for errors the conductor reports, else the gateway's "
                "code. ``param`` (OpenAI routes only) equals ``field``."),
        "GenerateRequest": _obj({
            "model": MODEL, "text": {"type": "string", "examples": ["Hello, World."]}, "model_kwargs": KWARGS,
            "stream": {"type": "boolean", "description": "NDJSON lines as produced, else one JSON object"},
            "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": max_timeout_s,
                          "description": "seconds; the gateway's limit is the maximum"},
            "request_id": {"type": "string", "description": "client-chosen id, unique among in-flight requests"},
            "output": OUTPUT,
        }, ("model",)),
        "GenerateForm": _obj({
            "model": MODEL, "text": STR,
            "model_kwargs": {"type": "string", "description": "a JSON object"},
            "stream": {"enum": ["true", "false"]}, "timeout_s": {"type": "string", "description": "seconds"},
            "request_id": STR, "output": OUTPUT,
        }, ("model",), closed=False,
            doc="multipart/form-data: the JSON fields as form fields; any other part with a filename is an input "
                "file (its part name is the file's name, e.g. 'image')."),
        "Tensor": _obj({"datatype": STR, "shape": {"type": "array", "items": INT},
                        "data_b64": {"type": "string", "contentEncoding": "base64"},
                        "values": {"type": "array", "description": "ACTION chunks only: the elements as nested "
                                                                   "arrays of numbers (row-major, shape as above)"}},
                       ("datatype", "shape", "data_b64")),
        "GenerateLine": {"oneOf": [chunk_line, _obj({
            "type": {"const": "final"}, "request_id": STR, "usage": usage, "timings": timings,
            "finish_reason": {"type": "string", "description": "stop | length"},
        }, ("type", "request_id", "usage", "timings", "finish_reason")), _obj({
            "type": {"const": "error"}, "error": _obj({"code": STR, "message": STR}, ("code", "message")),
        }, ("type", "error"))], "description": "One NDJSON line of a streaming /generate."},
        "GenerateResult": _obj({
            "request_id": STR, "usage": usage, "timings": timings, "finish_reason": STR,
            "outputs": {"type": "object", "additionalProperties": _obj({
                "modality": STR, "num_chunks": INT, "token_ids": {"type": "array", "items": INT}, "text": STR,
                "data_b64": STR, "mime_type": STR, "sample_rate_hz": INT, "chunks": {"type": "array", "items": _ref("Tensor")},
            }, ("modality", "num_chunks", "token_ids"))},
        }, ("request_id", "outputs", "usage", "timings", "finish_reason")),
        "Health": _obj({"status": {"enum": ["ok", "unavailable"]}, "reason": STR}, ("status",)),
        "ModelList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _obj({
            "id": STR, "object": {"const": "model"}, "owned_by": STR,
            "walks": {"type": "array", "items": STR},
            "outputs": {"type": "array", "items": STR, "description": "name:modality"},
            "node_groups": {"type": "array", "items": STR}, "api": model_api,
        }, ("id", "object", "owned_by", "walks", "outputs", "node_groups", "api"))}}, ("object", "data")),
        "ChatCompletionRequest": _obj({
            "model": MODEL, "messages": {"type": "array", "minItems": 1, "items": message,
                                         "examples": [[{"role": "user", "content": "Hello"}]]},
            "stream": _or_null(BOOL),
            "stream_options": _or_null(_obj({"include_usage": _or_null(BOOL)})),
            "max_tokens": _or_null(INT), "max_completion_tokens": _or_null(INT),
            "temperature": _or_null(NUM), "top_p": _or_null(NUM), "presence_penalty": _or_null(NUM),
            "frequency_penalty": _or_null(NUM), "seed": _or_null(INT),
            "stop": {"anyOf": [STR, {"type": "array", "items": STR}, {"type": "null"}]},
            "model_kwargs": _or_null(KWARGS),
            "n": _or_null({"const": 1}), "logprobs": _or_null({"const": False}), "top_logprobs": _or_null({"const": 0}),
            "logit_bias": _or_null({"type": "object", "maxProperties": 0}),
            "tools": _or_null({"type": "array", "maxItems": 0}), "tool_choice": _or_null({"const": "none"}),
            "parallel_tool_calls": _or_null(BOOL), "functions": _or_null({"type": "array", "maxItems": 0}),
            "function_call": _or_null({"const": "none"}),
            "response_format": _or_null(_obj({"type": {"const": "text"}}, ("type",))),
            "modalities": _or_null({"type": "array", "items": {"enum": ["text", "audio"]}, "contains": {"const": "text"},
                                    "minItems": 1, "maxItems": 2, "uniqueItems": True,
                                    "description": '["text", "audio"]: a spoken answer too, for a model whose '
                                                   "api.chat_audio_output is set; others: a 400"}),
            "audio": _or_null(_obj({"voice": {"type": "string", "description": "one of the model's api.voices"},
                                    "format": {"enum": ["wav", "pcm16"], "description": "streaming: pcm16"}})),
            "store": _or_null({"const": False}), "user": _or_null(STR), "safety_identifier": _or_null(STR),
            "metadata": _or_null({"type": "object"}), "service_tier": _or_null({"enum": ["auto", "default"]}),
        }, ("model", "messages"), doc="Knobs go to the model as model_kwargs (max_tokens/max_completion_tokens as "
                                       "max_tokens); a model refusing one is a 400 naming it. Other OpenAI parameters "
                                       "are accepted only with values that change nothing."),
        "ChatCompletion": _obj({
            "id": STR, "object": {"const": "chat.completion"}, "created": INT, "model": STR,
            "system_fingerprint": {"type": "null"},
            "choices": {"type": "array", "items": _obj({
                "index": INT, "logprobs": {"type": "null"}, "finish_reason": STR,
                "message": _obj({"role": {"const": "assistant"}, "content": _or_null(STR), "refusal": {"type": "null"},
                                 "audio": chat_audio}, ("role", "content")),
            }, ("index", "message", "finish_reason"))},
            "usage": oai_usage,
        }, ("id", "object", "created", "model", "choices", "usage")),
        "ChatCompletionChunk": _obj({
            "id": STR, "object": {"const": "chat.completion.chunk"}, "created": INT, "model": STR,
            "system_fingerprint": {"type": "null"}, "usage": _or_null(oai_usage),
            "choices": {"type": "array", "items": _obj({
                "index": INT, "logprobs": {"type": "null"}, "finish_reason": _or_null(STR),
                "delta": _obj({"role": {"const": "assistant"}, "content": _or_null(STR), "audio": _obj({
                    "id": STR, "data": {"type": "string", "contentEncoding": "base64",
                                        "description": "PCM16 24 kHz mono little-endian"},
                    "transcript": STR, "expires_at": INT}, ("id",))}),
            }, ("index", "delta", "finish_reason"))},
        }, ("id", "object", "created", "model", "choices"),
            doc="One `data:` event of a streaming chat completion; the stream ends with `data: [DONE]`."),
        "SpeechRequest": _obj({
            "model": MODEL, "input": {"type": "string", "minLength": 1, "examples": ["Hello"]},
            "voice": _or_null({"type": "string", "description": "model_kwargs.voice; 'default' = the model's own"}),
            "response_format": _or_null({"enum": ["wav", "pcm"]}),
            "stream_format": _or_null({"enum": ["audio", "sse"]}),
            "temperature": _or_null(NUM), "top_p": _or_null(NUM), "seed": _or_null(INT), "max_tokens": _or_null(INT),
            "speed": _or_null({"const": 1}), "instructions": _or_null({"const": ""}),
            "model_kwargs": _or_null(KWARGS),
        }, ("model", "input"), doc="stream_format 'sse' needs response_format 'pcm'. temperature, top_p, seed and "
                                   "max_tokens go to the model as model_kwargs; a model refusing one is a 400 "
                                   "naming it."),
        "SpeechEvent": {"oneOf": [
            _obj({"type": {"const": "speech.audio.delta"}, "audio": {"type": "string", "contentEncoding": "base64"},
                  "sample_rate_hz": INT}, ("type", "audio", "sample_rate_hz")),
            _obj({"type": {"const": "speech.audio.done"}, "usage": _obj(
                {"input_tokens": INT, "output_tokens": INT, "total_tokens": INT},
                ("input_tokens", "output_tokens", "total_tokens"))}, ("type", "usage")),
        ], "description": "One `data:` event of /v1/audio/speech with stream_format 'sse'."},
        "ImagesRequest": _obj({
            "model": MODEL, "prompt": {"type": "string", "minLength": 1}, **image_knobs,
            "model_kwargs": _or_null(KWARGS),
        }, ("model", "prompt"), doc="Only for models with an image output; others are a 400 naming model. size -> "
                                    "model_kwargs width/height, n (when not 1), seed, steps, guidance -> cfg_text; the "
                                    "model checks their ranges (a 400 naming the parameter)."),
        "ImagesEditForm": _obj({
            "model": MODEL, "prompt": {"type": "string", "minLength": 1},
            "image": {"type": "string", "format": "binary", "description": "PNG, JPEG or WebP"},
            "image[]": {"type": "string", "format": "binary", "description": "the same as image (send one of them)"},
            **image_knobs, "image_guidance": _or_null(NUM),
            "model_kwargs": {"type": "string", "description": "a JSON object"},
        }, ("model", "prompt"), doc="multipart/form-data; one image part is required (image or image[]). For models "
                                    "whose api has edit_kwargs (BAGEL: the output keeps the input's size, so size must "
                                    "be auto); numbers are form text. image_guidance -> cfg_img."),
        "ImagesResponse": _obj({"created": INT, "data": {"type": "array", "items": _obj(
            {"b64_json": {"type": "string", "contentEncoding": "base64"}}, ("b64_json",))}}, ("created", "data")),
    }


#: a served model's id (``/v1/models``) is what the request routes take as ``model`` (stateful clients and
#: fuzzers follow these: schemathesis's stateful phase)
_MODEL_LINKS = {
    f"{op}WithServedModel": {"operationId": op, "requestBody": {"model": "$response.body#/data/0/id", **body},
                             "description": f"{op} with the first served model"}
    for op, body in (("generate", {"text": "Hello"}),
                     ("createChatCompletion", {"messages": [{"role": "user", "content": "Hello"}]}),
                     ("createSpeech", {"input": "Hello", "voice": "tara"}),
                     ("createImage", {"prompt": "Hello"}))
}


def build(settings: GatewaySettings) -> dict:
    paths = {
        "/generate": {"post": {
            "operationId": "generate", "summary": "Run one request; NDJSON lines (stream) or one JSON object",
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": _ref("GenerateRequest")},
                "multipart/form-data": {"schema": _ref("GenerateForm")}}},
            "responses": {"200": {"description": "the request's outputs; by the Accept header (the first listed of "
                                                 "these types): JSON / NDJSON, one tensor's raw bytes, or multipart parts",
                                  "headers": {"X-Request-Id": {"schema": STR}, **TENSOR_HEADERS}, "content": {
                "application/json": {"schema": _ref("GenerateResult")},
                "application/x-ndjson": {"schema": {"type": "string",
                                                    "description": "GenerateLine objects, one per line"}},
                "application/octet-stream": {"schema": {
                    "type": "string", "format": "binary", "description": "one tensor output (the `output` field, or the "
                    "only one): little-endian row-major bytes; datatype and shape in the X-Tensor-* headers"}},
                "multipart/mixed": {"schema": {
                    "type": "string", "format": "binary", "description": "streamed: one part per output chunk (headers "
                    "X-Chunk-Name, X-Chunk-Index, X-Chunk-Modality, Content-Length; a tensor's raw bytes with the "
                    "X-Tensor-* headers), then the final event (X-Chunk-Name: final) or an error as an application/json "
                    "part"}}}},
                          **_errors()}}},
        "/health": {"get": {"operationId": "health", "summary": "The conductor's health as the gateway sees it",
                            "responses": {"200": {"description": "serving", "content": {
                                "application/json": {"schema": _ref("Health")}}},
                                "503": {"description": "not serving", "content": {
                                    "application/json": {"schema": _ref("Health")}}}}}},
        "/v1/models": {"get": {"operationId": "listModels", "summary": "Served models (OpenAI list shape)",
                               "responses": {"200": {"description": "the models", "content": {
                                   "application/json": {"schema": _ref("ModelList")}}, "links": _MODEL_LINKS},
                                   **_errors("503", "504")}}},
        "/v1/chat/completions": {"post": {
            "operationId": "createChatCompletion",
            "summary": "OpenAI chat completions (text, and audio for models that declare it)",
            "requestBody": _json_body("ChatCompletionRequest"),
            "responses": {"200": {"description": "ChatCompletion, or ChatCompletionChunk events when streaming",
                                  "content": {"application/json": {"schema": _ref("ChatCompletion")},
                                              **_sse("ChatCompletionChunk", done=True)}},
                          **_errors()}}},
        "/v1/audio/speech": {"post": {
            "operationId": "createSpeech", "summary": "OpenAI text to speech (models with an audio output)",
            "requestBody": _json_body("SpeechRequest"),
            "responses": {"200": {"description": "streamed as made: WAV (header sizes 0xFFFFFFFF: length unknown), raw "
                                                 "PCM16 (rate in X-Sample-Rate-Hz) or SpeechEvent events",
                                  "headers": {"X-Sample-Rate-Hz": {"schema": STR}}, "content": {
                                      "audio/wav": {"schema": {"type": "string", "format": "binary"}},
                                      "audio/pcm": {"schema": {"type": "string", "format": "binary"}},
                                      **_sse("SpeechEvent")}},
                          **_errors()}}},
        "/v1/images/generations": {"post": {
            "operationId": "createImage", "summary": "OpenAI image generation (models with an image output)",
            "requestBody": _json_body("ImagesRequest"),
            "responses": {"200": {"description": "the images", "content": {
                "application/json": {"schema": _ref("ImagesResponse")}}}, **_errors()}}},
        "/v1/images/edits": {"post": {
            "operationId": "createImageEdit", "summary": "OpenAI image editing (models whose api has edit_kwargs)",
            "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _ref("ImagesEditForm")}}},
            "responses": {"200": {"description": "the edited images", "content": {
                "application/json": {"schema": _ref("ImagesResponse")}}}, **_errors()}}},
        "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics",
                             "responses": {"200": {"description": "text exposition format", "content": {
                                 "text/plain": {"schema": STR}}}}}},
        "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document",
                                  "responses": {"200": {"description": "OpenAPI 3.1", "content": {
                                      "application/json": {"schema": {"type": "object"}}}}}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "M* gateway", "version": "1",
                 "description": "REST in front of the M* conductor (gRPC mstar.v1.Conductor): the native /generate "
                                "and OpenAI-compatible routes. Every error is an Error object."},
        "paths": paths,
        "components": {"schemas": _schemas(settings.request_timeout_s)},
    }


SPEC = web.AppKey("openapi", dict)


async def openapi_handler(request: web.Request) -> web.Response:
    return web.json_response(request.app[SPEC])
