"""Reading what a client sends, with every request-sized cost bounded before it is paid.

One place for the checks the gateway (REST) and the conductor (gRPC) both make on a client's
values: JSON (depth, integer size, non-finite numbers, lone surrogates), request ids (they go
into HTTP headers), timeouts, and images (their size read from the header before any pixel is
decoded). Each failure is an ``Untrusted`` error (a ValueError) whose
message says what was wrong; the caller names the field.
"""

from __future__ import annotations

import json
import math
import re

#: deepest nesting of arrays and objects a JSON value may have (model_kwargs are flat knobs;
#: Python's parser gives up near 1,000 with a RecursionError)
MAX_JSON_DEPTH = 32
#: longest integer literal, in digits (2**64 has 20; Python refuses to convert past 4,300)
MAX_INT_DIGITS = 32
#: a request id: what clients use (UUIDs, ULIDs, "req-42", "trace/span"), nothing that could end or
#: split an HTTP header (the gateway answers it in X-Request-Id)
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@~-]{1,128}")
REQUEST_ID_RULE = "1-128 characters among letters, digits and . _ : / + = @ ~ -"


class Untrusted(ValueError):
    """A client's value refused; the message says why (without the field's name). ``path``: where
    in a JSON document (``temperature``, ``messages[0].content``); empty for the whole document."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path


class _HugeInt:
    """An integer literal too long to convert: kept as found, refused (naming where) after parsing."""

    def __init__(self, digits: int):
        self.digits = digits


def _bounded_int(text: str) -> int | _HugeInt:
    digits = len(text) - (text[0] == "-")
    return _HugeInt(digits) if digits > MAX_INT_DIGITS else int(text)


def loads(raw: str | bytes) -> object:
    """``json.loads`` for a client's document: an Untrusted error (never RecursionError, a
    ValueError from a huge integer, a NaN/Infinity/overflowing number or a string that cannot be
    sent on as UTF-8), naming where in the document the value is."""
    try:
        value = json.loads(raw, parse_int=_bounded_int)  # NaN, Infinity and 1e400 parse to floats: refused below
    except RecursionError:
        raise Untrusted(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise Untrusted(f"not valid UTF-8: {e}") from None
    except ValueError as e:  # json.JSONDecodeError and friends
        raise Untrusted(f"not valid JSON: {e}") from None
    check_value(value)
    return value


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_value(value: object, path: str = "") -> None:
    """Depth, numbers and strings of a parsed JSON value, without recursion."""
    stack = [(value, path, 1)]
    while stack:
        v, where, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v, where)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise Untrusted(f"must be a finite number, got {v}", where)
        elif isinstance(v, _HugeInt):
            raise Untrusted(f"an integer of {v.digits} digits; at most {MAX_INT_DIGITS} are accepted", where)
        elif isinstance(v, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise Untrusted(f"nested deeper than {MAX_JSON_DEPTH} levels", where)
            if isinstance(v, dict):
                for k, item in v.items():
                    _check_text(k, _join(where, "<key>"))
                    stack.append((item, _join(where, k), depth + 1))
            else:
                stack.extend((item, _join(where, i), depth + 1) for i, item in enumerate(v))


def _check_text(s: str, path: str) -> None:
    try:
        check_text(s)
    except Untrusted as e:
        e.path = path
        raise


def check_text(s: str) -> None:
    """A string that can be sent on as UTF-8 (JSON's ``\\ud800`` escape makes one that cannot)."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise Untrusted(f"contains a lone surrogate (\\u{ord(e.object[e.start]):04x}) at character {e.start}; "
                            "send valid Unicode") from None


def check_request_id(rid: str) -> None:
    """An empty id is fine (the server assigns one)."""
    if rid and not REQUEST_ID.fullmatch(rid):
        raise Untrusted(f"must be {REQUEST_ID_RULE}; got {rid[:40]!r}" + ("..." if len(rid) > 40 else ""))


def check_timeout(value: float, max_s: float) -> None:
    """``timeout_s``: 0 means the server's default; otherwise a finite number of seconds in (0, max_s]."""
    if value == 0:
        return
    if not math.isfinite(value) or value < 0:
        raise Untrusted(f"must be a positive number of seconds (0: the server's default), got {value}")
    if value > max_s:
        raise Untrusted(f"{value:g} s exceeds this server's limit of {max_s:g} s")


def open_image(data: bytes, max_pixels: int):
    """A client's image file -> its PIL image, decoded only once the size its header declares is at
    most ``max_pixels`` (a small compressed file can declare a huge image, whose RGB bytes and
    resize cost memory and CPU in proportion). ``Untrusted`` otherwise: too large, or not a
    decodable image. Needs Pillow."""
    import io

    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))  # the header only
    except Image.DecompressionBombError as e:  # past Pillow's own bound, before ours could look
        raise Untrusted(f"an image too large to decode ({e})") from None
    except Exception as e:  # Pillow raises several kinds (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise Untrusted(f"not a decodable image ({type(e).__name__})") from None
    w, h = image.size
    if w * h > max_pixels:
        image.close()
        raise Untrusted(f"an image of {w}x{h} pixels; at most {max_pixels} pixels")
    try:
        image.load()
    except Exception as e:
        raise Untrusted(f"not a decodable image ({type(e).__name__})") from None
    return image
