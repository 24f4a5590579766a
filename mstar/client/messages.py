"""Chat messages -> one prompt text: the rule shared by the SDK's ``chat()`` and the gateway's
``/v1/chat/completions``.

The rule: the prompt is the text of the **last message, which must have role "user"**. Its
``content`` is a string, or an array of ``{"type": "text", "text": ...}`` parts concatenated in
order. Earlier messages (system/developer instructions, previous turns) are checked for shape
and not sent: no model M* serves takes a conversation (the toy ROT13-"translates" one text,
Orpheus speaks one text), so folding turns into its prompt would change its output, not
inform it. A model with a chat template will need the turns on the wire; this is the one
place to change then.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mstar.client.errors import InvalidArgument

ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name"}


def _text_of(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes | bytearray):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise InvalidArgument(f"{where}[{j}]", f"{where}[{j}]: a content part must be an object")
            if part.get("type") != "text":
                raise InvalidArgument(f"{where}[{j}].type", f"{where}[{j}].type: only 'text' parts are supported, "
                                                            f"got {part.get('type')!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidArgument(f"{where}[{j}].text", f"{where}[{j}].text: must be a string")
            texts.append(text)
        return "".join(texts)
    if content is None:
        return ""
    raise InvalidArgument(where, f"{where}: must be a string or an array of text parts")


def prompt_from_messages(messages: object) -> str:
    """The prompt text for ``messages`` (OpenAI chat format); InvalidArgument names the bad field."""
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
        last = _text_of(m.get("content"), f"{where}.content")
    where = f"messages[{len(messages) - 1}]"
    if messages[-1]["role"] != "user":
        raise InvalidArgument(f"{where}.role", f"{where}.role: the last message must have role 'user' (M* prompts "
                                               f"the model with it), got {messages[-1]['role']!r}")
    if not last:
        raise InvalidArgument(f"{where}.content", f"{where}.content: the last user message must not be empty")
    return last
