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
from json import decoder, scanner
from typing import Any

from mstar.limits import MAX_JSON_DEPTH, MAX_JSON_VALUES, MIN_TIMEOUT_S

#: longest integer literal, in digits (2**64 has 20; Python refuses to convert past 4,300)
MAX_INT_DIGITS = 32
_HUGE = 10**MAX_INT_DIGITS
# json's pure-Python scanner and the parts it is built of (typeshed's stubs leave them out)
_WHITESPACE = decoder.WHITESPACE  # type: ignore[attr-defined]
_scanstring = decoder.scanstring  # type: ignore[attr-defined]
_py_make_scanner = scanner.py_make_scanner  # type: ignore[attr-defined]
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
    sent on as UTF-8), naming where in the document the value is. A document of more than
    ``MAX_JSON_VALUES`` values is refused as it is read, before it costs their memory."""
    try:
        if _most_values(raw) <= MAX_JSON_VALUES:  # C's parser, which cannot pass the bound
            value = _c_loads(raw)  # NaN, Infinity and 1e400 parse to floats: refused below
        else:
            value = _Bounded(MAX_JSON_VALUES).loads(raw.decode(json.detect_encoding(raw), "surrogatepass")
                                               if isinstance(raw, bytes) else raw)
    except RecursionError:
        raise Untrusted(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise Untrusted(f"not valid UTF-8: {e}") from None
    except ValueError as e:  # json.JSONDecodeError and friends; Untrusted from _Bounded
        raise (e if isinstance(e, Untrusted) else Untrusted(f"not valid JSON: {e}")) from None
    check_value(value)
    return value


def _c_loads(raw: str | bytes) -> object:
    """Integers as C's parser reads them (a callback for each costs 3x the parse); one too long for
    Python to convert (4,300 digits) fails the parse, and the second parse finds where it is."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:  # malformed: a second parse would fail the same way
        raise
    except ValueError:  # an integer past Python's 4,300 digits
        return json.loads(raw, parse_int=_bounded_int)


def _most_values(raw: str | bytes) -> int:
    """An upper bound on the values of a document, at the speed of memchr: every value but the
    first follows a comma or opens a container (commas and brackets inside strings count too)."""
    if isinstance(raw, bytes):
        return 1 + raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    return 1 + raw.count(",") + raw.count("[") + raw.count("{")


class _Bounded:
    """json's pure-Python scanner (strings still scanned in C) counting values and depth as it goes,
    for a document that may hold more values than allowed: it stops at the first one past the bound
    (in ~1.5 us a value), where C's parser would build them all (~100 bytes each) before any check."""

    def __init__(self, max_values: int):
        self.max_values, self.values, self.depth = max_values, 0, 0
        self.member = ""  # the top-level member being read: where a refusal is named
        context: Any = json.JSONDecoder(parse_int=_bounded_int)
        context.parse_object, context.parse_array = self._object, self._array
        self._scan = _py_make_scanner(context)

    def loads(self, s: str) -> object:
        end = _WHITESPACE.match(s, 0).end()
        value, end = self._root(s, end) if s.startswith("{", end) else self._value(s, end)
        end = _WHITESPACE.match(s, end).end()
        if end != len(s):
            raise json.JSONDecodeError("Extra data", s, end)
        return value

    def _value(self, s: str, idx: int) -> tuple[object, int]:
        self.values += 1
        if self.values > self.max_values:
            raise Untrusted(f"more than {self.max_values} JSON values in one document", self.member)
        try:
            return self._scan(s, idx)
        except StopIteration as e:
            raise json.JSONDecodeError("Expecting value", s, e.value) from None

    def _nested(self, parse, *args) -> tuple[object, int]:
        self.depth += 1
        if self.depth > MAX_JSON_DEPTH:  # unnamed, as when C's parser gives up on the nesting
            raise Untrusted(f"nested deeper than {MAX_JSON_DEPTH} levels")
        try:
            return parse(*args)
        finally:
            self.depth -= 1

    def _object(self, s_and_end, strict, _scan, object_hook, object_pairs_hook, memo=None):
        return self._nested(decoder.JSONObject, s_and_end, strict, self._value, object_hook, object_pairs_hook, memo)

    def _array(self, s_and_end, _scan):
        return self._nested(decoder.JSONArray, s_and_end, self._value)

    def _root(self, s: str, idx: int) -> tuple[dict, int]:
        """The top-level object, member by member, so that a refusal names the member it is in."""
        self.values, self.depth = 1, 1
        out: dict[str, object] = {}
        end = _WHITESPACE.match(s, idx + 1).end()
        if s.startswith("}", end):
            return out, end + 1
        while True:
            if not s.startswith('"', end):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", s, end)
            key, end = _scanstring(s, end + 1)
            end = _WHITESPACE.match(s, end).end()
            if not s.startswith(":", end):
                raise json.JSONDecodeError("Expecting ':' delimiter", s, end)
            self.member = key
            out[key], end = self._value(s, _WHITESPACE.match(s, end + 1).end())
            end = _WHITESPACE.match(s, end).end()
            if s.startswith("}", end):
                return out, end + 1
            if not s.startswith(",", end):
                raise json.JSONDecodeError("Expecting ',' delimiter", s, end)
            end = _WHITESPACE.match(s, end + 1).end()


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_value(value: object, path: str = "") -> None:
    """Depth, numbers and strings of a parsed JSON value, without recursion: a pass level by level
    that builds no paths (~0.1 us a value), then, only if it found something, the pass that names it."""
    if not _clean(value):
        _name_fault(value, path)


def _clean(value: object) -> bool:
    level: list[Any] = [value]
    depth = 1
    while level:
        below: list[Any] = []
        for v in level:
            t = type(v)
            if t is str:
                if not v.isascii() and not _encodes(v):
                    return False
            elif t is dict:
                if depth > MAX_JSON_DEPTH or not all(k.isascii() or _encodes(k) for k in v):
                    return False
                below.extend(v.values())
            elif t is list:
                if depth > MAX_JSON_DEPTH:
                    return False
                below.extend(v)
            elif t is int:
                if not -_HUGE < v < _HUGE:
                    return False
            elif t is float:
                if not math.isfinite(v):
                    return False
            elif t is _HugeInt:
                return False
        level, depth = below, depth + 1
    return True


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _name_fault(value: object, path: str) -> None:
    """The first fault of ``value`` in document order, raised with its path."""
    stack = [(value, path, 1)]
    while stack:
        v, where, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v, where)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise Untrusted(f"must be a finite number, got {v}", where)
        elif isinstance(v, _HugeInt) or type(v) is int and not -_HUGE < v < _HUGE:
            digits = v.digits if isinstance(v, _HugeInt) else len(str(abs(v)))
            raise Untrusted(f"an integer of {digits} digits; at most {MAX_INT_DIGITS} are accepted", where)
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
    """``timeout_s``: 0 means the server's default; otherwise a finite number of seconds in
    [MIN_TIMEOUT_S, max_s]."""
    if value == 0:
        return
    if not math.isfinite(value) or value < 0:
        raise Untrusted(f"must be a positive number of seconds (0: the server's default), got {value}")
    if value < MIN_TIMEOUT_S:
        raise Untrusted(f"{value:g} s is below the smallest timeout, {MIN_TIMEOUT_S:g} s (0: the server's default)")
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
