"""Chat messages -> one prompt text: the rule shared by the SDK's ``chat()`` and the gateway's
``/v1/chat/completions``.

The rule: the prompt is the text of the **last message, which must have role "user"**. Its
``content`` is a string, or an array of ``{"type": "text", "text": ...}`` parts concatenated in
order. Earlier messages (system/developer instructions, previous turns) are checked for shape
and not sent: no model M* serves takes a conversation (the toy ROT13-"translates" one text,
Orpheus speaks one text), so folding turns into its prompt would change its output, not
inform it. A model with a chat template will need the turns on the wire; this is the one
place to change then.

``chat_from_messages`` also reads the media parts of the last message (``image_url``,
``input_audio``, and M*'s ``video_url``; inline ``data:`` URLs / base64 only: M* fetches
nothing) into files, in order; media in earlier messages is refused, since they are not sent.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mstar.client.errors import InvalidArgument

ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name"}


#: content part type -> (the media kind it carries, the key of its object)
MEDIA_PARTS = {"image_url": ("image", "image_url"), "input_audio": ("audio", "input_audio"),
               "video_url": ("video", "video_url")}
#: input_audio.format -> content type
AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg"}


@dataclass(frozen=True)
class MediaPart:
    """A media content part of the last message, decoded: ``where`` names it in errors
    (``messages[0].content[1]``)."""

    kind: str  # "image" | "audio" | "video"
    data: bytes
    content_type: str
    where: str


@dataclass(frozen=True)
class ChatInput:
    text: str
    media: tuple[MediaPart, ...] = ()


def _b64(value: object, where: str) -> bytes:
    if not isinstance(value, str):
        raise InvalidArgument(where, f"{where}: must be a base64 string")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(where, f"{where}: not valid base64") from None
    if not data:
        raise InvalidArgument(where, f"{where}: empty")
    return data


def data_url(url: object, kind: str, where: str) -> tuple[bytes, str]:
    """``data:<kind>/<subtype>;base64,<data>`` -> (bytes, content type). Remote URLs are refused:
    the gateway fetches nothing on a client's behalf (no fetch policy, no SSRF surface)."""
    if not isinstance(url, str):
        raise InvalidArgument(where, f"{where}: must be a string")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "no scheme"
        raise InvalidArgument(where, f"{where}: only inline data: URLs (data:{kind}/...;base64,...) are accepted; "
                                     f"M* fetches no remote media (got {scheme!r})")
    head, sep, payload = url[5:].partition(",")
    params = head.split(";")
    if not sep or "base64" not in params[1:]:
        raise InvalidArgument(where, f"{where}: a data: URL must be base64 (data:{kind}/...;base64,...)")
    mime = params[0].strip().lower()
    if mime.split("/")[0] != kind:
        raise InvalidArgument(where, f"{where}: a {kind} part needs a {kind}/* data: URL, got {mime or 'no type'!r}")
    return _b64(payload, where), mime


def _media(part: Mapping, ptype: str, where: str) -> MediaPart:
    kind, key = MEDIA_PARTS[ptype]
    body = part.get(key)
    if not isinstance(body, Mapping):
        raise InvalidArgument(f"{where}.{key}", f"{where}.{key}: must be an object")
    if ptype == "input_audio":
        fmt = body.get("format")
        if not isinstance(fmt, str) or fmt not in AUDIO_FORMATS:
            raise InvalidArgument(f"{where}.{key}.format", f"{where}.{key}.format: must be one of "
                                                           f"{', '.join(AUDIO_FORMATS)}, got {fmt!r}")
        for k in body:
            if k not in ("data", "format"):
                raise InvalidArgument(f"{where}.{key}.{k}", f"{where}.{key}.{k}: not supported")
        return MediaPart(kind, _b64(body.get("data"), f"{where}.{key}.data"), AUDIO_FORMATS[fmt], where)
    for k in body:
        if k not in ("url", "detail"):
            raise InvalidArgument(f"{where}.{key}.{k}", f"{where}.{key}.{k}: not supported")
    if body.get("detail") not in (None, "auto", "low", "high"):
        raise InvalidArgument(f"{where}.{key}.detail", f"{where}.{key}.detail: must be auto, low or high")
    data, mime = data_url(body.get("url"), kind, f"{where}.{key}.url")
    return MediaPart(kind, data, mime, where)


def _content(content: object, where: str, media_ok: bool | None) -> tuple[str, list[MediaPart]]:
    """``media_ok``: None where no media is read at all (prompt_from_messages), False in earlier messages."""
    if isinstance(content, str):
        return content, []
    if isinstance(content, Sequence) and not isinstance(content, bytes | bytearray):
        texts, media = [], []
        for j, part in enumerate(content):
            at = f"{where}[{j}]"
            if not isinstance(part, Mapping):
                raise InvalidArgument(at, f"{at}: a content part must be an object")
            ptype = part.get("type")
            if not isinstance(ptype, str):
                raise InvalidArgument(f"{at}.type", f"{at}.type: must be a string")
            if ptype in MEDIA_PARTS and media_ok is None:
                raise InvalidArgument(f"{at}.type", f"{at}.type: only 'text' parts are supported here, got {ptype!r}")
            if ptype in MEDIA_PARTS:
                if not media_ok:
                    raise InvalidArgument(at, f"{at}: media parts go in the last message, a user message (earlier "
                                              "messages are not sent to the model)")
                media.append(_media(part, ptype, at))
                continue
            if ptype != "text":
                raise InvalidArgument(f"{at}.type", f"{at}.type: must be text, {', '.join(MEDIA_PARTS)}; "
                                                    f"got {ptype!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidArgument(f"{at}.text", f"{at}.text: must be a string")
            texts.append(text)
        return "".join(texts), media
    if content is None:
        return "", []
    raise InvalidArgument(where, f"{where}: must be a string or an array of content parts")


def prompt_from_messages(messages: object) -> str:
    """The prompt text for ``messages`` (OpenAI chat format, text parts only); InvalidArgument
    names the bad field."""
    chat = chat_from_messages(messages, media=False)
    return chat.text


def chat_from_messages(messages: object, *, media: bool = True) -> ChatInput:
    """The prompt text and the last message's media parts (``media=False``: a media part is an
    error); InvalidArgument names the bad field."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise InvalidArgument("messages", "messages: must be a non-empty array of {role, content} objects")
    last = ""
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise InvalidArgument(where, f"{where}: must be an object with role and content")
        for key in m:
            if key not in _MESSAGE_KEYS:
                raise InvalidArgument(f"{where}.{key}", f"{where}.{key}: not supported; a message has "
                                                        f"{', '.join(sorted(_MESSAGE_KEYS))}")
        if m.get("role") not in ROLES:
            raise InvalidArgument(f"{where}.role", f"{where}.role: must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        if "name" in m and m["name"] is not None and not isinstance(m["name"], str):
            raise InvalidArgument(f"{where}.name", f"{where}.name: must be a string")
        last, parts = _content(m.get("content"), f"{where}.content", i == len(messages) - 1 if media else None)
    where = f"messages[{len(messages) - 1}]"
    if messages[-1]["role"] != "user":
        raise InvalidArgument(f"{where}.role", f"{where}.role: the last message must have role 'user' (M* prompts "
                                               f"the model with it), got {messages[-1]['role']!r}")
    if not last and not parts:
        raise InvalidArgument(f"{where}.content", f"{where}.content: the last user message must not be empty")
    return ChatInput(last, tuple(parts))
