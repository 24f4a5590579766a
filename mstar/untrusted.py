"""Reading what a client sends, with every request-sized cost bounded before it is paid.

One place for the checks the gateway (REST) and the conductor (gRPC) both make on a client's
values: JSON (depth, integer size, non-finite numbers, lone surrogates), request ids (they go
into HTTP headers) and timeouts. Each failure is an ``Untrusted`` error (a ValueError) whose
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
    """A client's value refused; the message says why (without the field's name)."""


def _refuse_constant(name: str) -> float:
    raise Untrusted(f"{name} is not a number JSON allows; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Untrusted(f"number {text[:40]} is out of range (it overflows a 64-bit float)")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > MAX_INT_DIGITS:
        raise Untrusted(f"an integer of {digits} digits; at most {MAX_INT_DIGITS} are accepted")
    return int(text)


def loads(raw: str | bytes) -> object:
    """``json.loads`` for a client's document: an Untrusted error (never RecursionError,
    a ValueError from a huge integer, NaN/Infinity, or a string that cannot be sent on as UTF-8)."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except Untrusted:
        raise
    except RecursionError:
        raise Untrusted(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise Untrusted(f"not valid UTF-8: {e}") from None
    except ValueError as e:  # json.JSONDecodeError and friends
        raise Untrusted(f"not valid JSON: {e}") from None
    check_value(value)
    return value


def check_value(value: object) -> None:
    """Depth and strings of a parsed JSON value, without recursion."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            check_text(v)
        elif isinstance(v, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise Untrusted(f"nested deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    check_text(k)
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in v)


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
