"""Reading and validating a ``POST /generate`` body (JSON or multipart) into a GenerateBody.

Everything a client can get wrong is caught here, before the conductor sees the request,
and answered with an ApiError naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import BodyPartReader, hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from mstar import untrusted
from mstar.gateway.errors import ApiError, bad_request, too_large
from mstar.gateway.json_body import check_json_type, read_json_body, read_json_field
from mstar.gateway.json_bounds import json_type
from mstar.gateway.uploads import RequestFiles
from mstar.limits import MIN_TIMEOUT_S

FIELDS = ("model", "text", "model_kwargs", "stream", "timeout_s", "request_id", "output")
_READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class Upload:
    """A file part of a multipart body."""

    name: str
    content_type: str
    data: bytes = b""
    #: where the bytes are instead, when the part was spilled to the upload dir (uploads.py)
    path: Path | None = None

    def read(self) -> bytes:
        return self.path.read_bytes() if self.path is not None else self.data


@dataclass(frozen=True)
class GenerateBody:
    model: str
    text: str = ""
    model_kwargs: dict = field(default_factory=dict)
    stream: bool = False
    #: seconds; 0 leaves the conductor's default timeout in force
    timeout_s: float = 0.0
    #: empty: the conductor assigns one
    request_id: str = ""
    files: tuple[Upload, ...] = ()
    #: the tensor output an ``Accept: application/octet-stream`` answer carries (binary.py); empty: the only one
    output: str = ""


async def read_generate_body(request: web.Request, max_bytes: int, max_timeout_s: float,
                             spill: RequestFiles | None = None) -> GenerateBody:
    """``spill``: where file parts larger than its ``spill_bytes`` go (None: memory)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large(max_bytes)
    if request.content_type == "application/json":
        return _validate(await read_json_body(request, max_bytes, "generate", max_timeout_s), max_timeout_s)
    if request.content_type == "multipart/form-data":
        return await _from_multipart(request, max_bytes, max_timeout_s, spill)
    sent = request.headers.get(hdrs.CONTENT_TYPE, "no Content-Type")
    raise ApiError(415, f"unsupported Content-Type '{sent}'; send application/json or multipart/form-data",
                   code="UNSUPPORTED_MEDIA_TYPE")


async def read_json_object(request: web.Request, max_bytes: int, shape: str, wait_s: float) -> dict:
    """A body that must be one JSON object (the OpenAI-compatible routes), shaped by
    ``json_bounds.SHAPES[shape]``; ``wait_s``: the longest its caller waits for a turn (json_fair.py)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large(max_bytes)
    check_json_type(request)
    return await read_json_body(request, max_bytes, shape, wait_s)


async def _from_multipart(request: web.Request, max_bytes: int, max_timeout_s: float,
                          spill: RequestFiles | None) -> GenerateBody:
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as e:
        raise bad_request(None, f"malformed multipart body: {e}") from None
    values: dict[str, object] = {}
    files: list[Upload] = []
    total = 0
    while True:
        try:
            part = await reader.next()
        except (ValueError, AssertionError, HttpProcessingError) as e:  # e.g. a part's header is not valid HTTP
            raise bad_request(None, f"malformed multipart body: {e}") from None
        if part is None:
            break
        if not isinstance(part, BodyPartReader):
            raise bad_request(None, "nested multipart bodies are not supported")
        name = part.name
        if not name:
            raise bad_request(None, "every multipart part needs a name in its Content-Disposition")
        is_file = name not in FIELDS and part.filename is not None
        data, size = await _read_part(part, max_bytes - total, max_bytes, spill if is_file else None)
        total += size
        if name in FIELDS:  # a known field wins even when sent as a file (curl -F model_kwargs=@kw.json)
            if name in values:
                raise bad_request(name, f"{name}: sent more than once")
            values[name] = await _form_value(request, name, data, max_timeout_s)
        elif is_file:
            content_type = part.headers.get(hdrs.CONTENT_TYPE, "application/octet-stream")
            files.append(Upload(name, content_type, path=data) if isinstance(data, Path) else
                         Upload(name, content_type, data))
        else:
            raise bad_request(name, f"unknown form field '{name}'; fields are {', '.join(FIELDS)}, "
                                    "and a file part needs a filename")
    return _validate(values, max_timeout_s, tuple(files))


async def _read_part(part: BodyPartReader, budget: int, max_bytes: int,
                     spill: RequestFiles | None = None) -> tuple[bytes | Path, int]:
    """The part's bytes, or the file they were spilled to once past ``spill.spill_bytes``; and their count."""
    buf, size = bytearray(), 0
    path, out = None, None
    try:
        while chunk := await part.read_chunk(_READ_CHUNK):
            size += len(chunk)
            if size > budget:
                raise too_large(max_bytes)
            if out is None and spill is not None and size > spill.spill_bytes:
                path = spill.new_file()
                out = open(path, "wb")  # closed in the finally
                spill.reserve(len(buf))
                out.write(buf)
                buf = bytearray()
            if out is not None:
                spill.reserve(len(chunk))
                out.write(chunk)
            else:
                buf += chunk
    finally:
        if out is not None:
            out.close()
    return (path, size) if path is not None else (bytes(buf), size)


async def _form_value(request: web.Request, name: str, data: bytes, max_timeout_s: float) -> object:
    """Form fields arrive as strings; give them the JSON types _validate expects."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(name, f"{name}: not valid UTF-8") from None
    if name == "model_kwargs":
        return await read_json_field(request, name, data, max_timeout_s)
    if name == "stream":
        flag = text.strip().lower()
        if flag not in ("true", "false"):
            raise bad_request(name, f"stream: must be 'true' or 'false', got '{text}'")
        return flag == "true"
    if name == "timeout_s":
        try:
            return float(text)
        except ValueError:
            raise bad_request(name, f"timeout_s: must be a number of seconds, got '{text}'") from None
    return text


def _validate(values: dict, max_timeout_s: float, files: tuple[Upload, ...] = ()) -> GenerateBody:
    for key in values:
        if key not in FIELDS:
            raise bad_request(key, f"unknown field '{key}'; allowed: {', '.join(FIELDS)}")
    if "model" not in values:
        raise bad_request("model", "model: required")
    for key, kind in (("model", str), ("text", str), ("request_id", str), ("stream", bool), ("model_kwargs", dict),
                      ("output", str)):
        if key in values and not isinstance(values[key], kind):
            raise bad_request(key, f"{key}: must be {json_type(kind())}, got {json_type(values[key])}")
    if not values["model"]:
        raise bad_request("model", "model: must not be empty")
    try:  # it is answered in the X-Request-Id header
        untrusted.check_request_id(values.get("request_id", ""))
    except untrusted.Untrusted as e:
        raise bad_request("request_id", f"request_id: {e}") from None
    timeout_s = values.get("timeout_s", 0.0)
    if "timeout_s" in values:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
            raise bad_request("timeout_s", f"timeout_s: must be a number, got {json_type(timeout_s)}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise bad_request("timeout_s", f"timeout_s: must be a positive number of seconds, got {timeout_s}")
        if timeout_s < MIN_TIMEOUT_S:
            raise bad_request("timeout_s", f"timeout_s: {timeout_s:g} s is below the smallest timeout, "
                                           f"{MIN_TIMEOUT_S:g} s")
        if timeout_s > max_timeout_s:
            raise bad_request("timeout_s", f"timeout_s: {timeout_s:g} s exceeds this gateway's limit of {max_timeout_s:g} s")
    return GenerateBody(model=values["model"], text=values.get("text", ""), model_kwargs=values.get("model_kwargs", {}),
                        stream=values.get("stream", False), timeout_s=float(timeout_s),
                        request_id=values.get("request_id", ""), files=files, output=values.get("output", ""))
