"""schemathesis hooks for test_fuzz_gateway.py (loaded through SCHEMATHESIS_HOOKS): whatever it
sends, the gateway answers a 2xx or a 4xx whose body is the JSON Error object, never a 5xx; and a
request that breaks the document (a negative case) is refused as malformed (REFUSALS), not with a
status that blames the server or the load (429, 409). The one 5xx allowed is 504
DEADLINE_EXCEEDED for a request whose own ``timeout_s`` is under a second (the deadline it asked for)."""

from __future__ import annotations

import json

import schemathesis

TINY_TIMEOUT_S = 1.0
#: what a malformed request may be refused with (error ``code``): the gateway's own validation,
#: an unknown model, a wrong Content-Type / method / size
REFUSALS = {"INVALID_ARGUMENT", "NOT_FOUND", "UNSUPPORTED_MEDIA_TYPE", "PAYLOAD_TOO_LARGE", "METHOD_NOT_ALLOWED",
            "NOT_ACCEPTABLE"}


def _asked_tiny_timeout(case) -> bool:
    body = case.body
    value = body.get("timeout_s") if isinstance(body, dict) else None
    try:
        return value is not None and float(value) < TINY_TIMEOUT_S
    except (TypeError, ValueError):
        return False


def _negative(case) -> bool:
    meta = getattr(case, "meta", None)
    mode = getattr(getattr(meta, "generation", None), "mode", None)
    return getattr(mode, "name", "") == "NEGATIVE"


@schemathesis.check
def no_5xx_and_malformed_is_refused_as_such(ctx, response, case):
    status = response.status_code
    if status < 400:
        return None
    if status >= 500 and not (status == 504 and _asked_tiny_timeout(case)):
        raise AssertionError(f"server error {status}: {response.text[:300]}")
    content_type = response.headers.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    if not content_type.startswith("application/json"):
        raise AssertionError(f"{status} answered with Content-Type {content_type!r}, not a JSON error")
    err = json.loads(response.content).get("error")
    if not (isinstance(err, dict) and isinstance(err.get("message"), str) and err.get("message")
            and isinstance(err.get("code"), str)):
        raise AssertionError(f"{status} without an error object: {response.text[:300]}")
    if _negative(case) and err["code"] not in REFUSALS:
        raise AssertionError(f"a malformed request got {status} {err['code']}, not a refusal: {err['message'][:200]}")
    return None
