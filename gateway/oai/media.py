"""Media on the OpenAI routes: chat content parts and uploaded images become GenerateRequest
files (of the kinds the model declares in its ModelApi), OpenAI ``size`` strings become
width and height, PCM16 becomes WAV. Everything wrong is a 400 naming the field it came from.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mstar.client.messages import MediaPart
from mstar.gateway.errors import bad_request
from mstar.v1 import conductor_pb2 as cpb

#: magic bytes of the image formats the image routes take -> their MIME type
IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"))
SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


def media_files(parts: Sequence[MediaPart], api: cpb.ModelApi, model: str) -> list[cpb.InputFile]:
    """One file per media part, named by kind and position (``image0``, ``audio1``); a kind the
    model does not take is a 400 naming the part."""
    files = []
    for i, part in enumerate(parts):
        if part.kind not in api.chat_media:
            takes = ", ".join(api.chat_media) or "text only"
            raise bad_request(part.where, f"{part.where}: model '{model}' takes no {part.kind} input in chat "
                                          f"(it takes: {takes})")
        files.append(cpb.InputFile(name=f"{part.kind}{i}", content_type=part.content_type, data=part.data))
    return files


def image_type(data: bytes) -> str | None:
    """PNG, JPEG or WebP by their magic bytes; None for anything else."""
    for magic, mime in IMAGE_MAGIC:
        if data.startswith(magic):
            return mime
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def parse_size(value: str, param: str = "size") -> tuple[int, int] | None:
    """OpenAI's ``"WIDTHxHEIGHT"`` (``"1024x768"``: 1024 wide, 768 high) -> (width, height);
    ``"auto"`` -> None (the model's default). The model checks the range (a 400 naming ``size``)."""
    if value == "auto":
        return None
    m = SIZE.match(value)
    if m is None:
        raise bad_request(param, f"{param}: must be 'auto' or WIDTHxHEIGHT in pixels (e.g. '1024x768'), got {value!r}")
    return int(m.group(1)), int(m.group(2))
