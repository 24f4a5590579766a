"""What a JSON body may hold, checked where it is parsed: on the event loop for a small body, in a
worker process for a large one (json_pool.py), by the same ``parse``.

``parse(raw, shape)`` reads a document with untrusted.loads (depth, value count, numbers, strings:
mstar/limits.py) and then applies the route's shape, named so that a worker can be told it
(``SHAPES``): the bounds only that route's fields have (messages, content parts, text characters)
and, for chat, the reading of ``messages`` itself (base64 media decoded: ~120 ms for a 24 MiB
image, which must not run on the loop either). A refusal comes back as data (``Refused``), never
as an exception to unpickle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mstar import untrusted
from mstar.client.errors import InvalidArgument
from mstar.client.messages import ChatInput, chat_from_messages
from mstar.limits import MAX_CHAT_MESSAGES, MAX_CONTENT_PARTS, MAX_TEXT_CHARS


@dataclass(frozen=True)
class Refused:
    """A document refused: ``path`` is where in it ('' for the whole), ``reason`` why, without the path;
    ``malformed``: not a JSON document the gateway reads at all (bad syntax, encoding, nesting)."""

    path: str
    reason: str
    malformed: bool = False


class Refusal(Exception):
    """Raised by a shape: the field at fault (a path in the document) and why."""

    def __init__(self, path: str, reason: str):
        super().__init__(reason)
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class ReadMessages:
    """A chat's ``messages`` as chat_from_messages read them: the prompt and media, or the error it
    raised, kept to be raised where the route takes ``messages`` (so errors keep their order)."""

    chat: ChatInput | None
    field: str | None = None
    message: str = ""

    def result(self) -> ChatInput:
        if self.chat is None:
            raise InvalidArgument(self.field, self.message)
        return self.chat


def parse(raw: bytes, shape: str) -> object:
    """The document ``raw`` shaped by ``SHAPES[shape]``, or a ``Refused``."""
    try:
        value = untrusted.loads(raw)
    except untrusted.Untrusted as e:
        return Refused(e.path, str(e), malformed=not e.path)
    try:
        return SHAPES[shape](value)
    except Refusal as e:
        return Refused(e.path, e.reason)


def _object(value: object) -> dict:
    if not isinstance(value, dict):
        raise Refusal("", f"the body must be a JSON object, got {json_type(value)}")
    return value


def _text_chars(value: dict, name: str) -> dict:
    text = value.get(name)
    if isinstance(text, str) and len(text) > MAX_TEXT_CHARS:
        raise Refusal(name, f"{len(text)} characters; at most {MAX_TEXT_CHARS} are accepted")
    return value


def chat(value: object) -> dict:
    """/v1/chat/completions: messages, parts a message and text characters bounded, then messages read."""
    body = _object(value)
    messages = body.get("messages")
    if not isinstance(messages, list):  # absent or not an array: the route's own check names it
        return body
    if len(messages) > MAX_CHAT_MESSAGES:
        raise Refusal("messages", f"{len(messages)} messages; at most {MAX_CHAT_MESSAGES} are accepted")
    chars = 0
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        where = f"messages[{i}].content"
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            if len(content) > MAX_CONTENT_PARTS:
                raise Refusal(where, f"{len(content)} content parts; at most {MAX_CONTENT_PARTS} are accepted")
            chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        if chars > MAX_TEXT_CHARS:
            raise Refusal(where, f"the messages' text passes {MAX_TEXT_CHARS} characters here; at most "
                                 f"{MAX_TEXT_CHARS} are accepted")
    try:
        body["messages"] = ReadMessages(chat_from_messages(messages))
    except InvalidArgument as e:
        body["messages"] = ReadMessages(None, e.field, e.message)
    return body


#: a route's shape, by the name the worker is sent
SHAPES: dict[str, Callable[[object], object]] = {
    "generate": lambda v: _text_chars(_object(v), "text"),
    "chat": chat,
    "speech": lambda v: _text_chars(_object(v), "input"),
    "images": lambda v: _text_chars(_object(v), "prompt"),
    "value": lambda v: v,  # a JSON form field (model_kwargs of a multipart body): its route checks it
}


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
