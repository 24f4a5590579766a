"""schemathesis hooks (loaded by test_openapi.py through SCHEMATHESIS_HOOKS): the gateway's
promise for every input, good or bad — a 2xx, or a 4xx whose body is the JSON Error object;
never a 5xx. The one 5xx allowed is 504 DEADLINE_EXCEEDED for a request whose own
``timeout_s`` is under a second: the client asked for that deadline and it passed."""

from __future__ import annotations

import json

import schemathesis

TINY_TIMEOUT_S = 1.0


def _asked_tiny_timeout(case) -> bool:
    body = case.body
    value = body.get("timeout_s") if isinstance(body, dict) else None
    try:
        return value is not None and float(value) < TINY_TIMEOUT_S
    except (TypeError, ValueError):
        return False


@schemathesis.check
def json_errors_and_no_server_error(ctx, response, case):
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
    return None
