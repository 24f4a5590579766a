"""Mooncake transfer-engine transport (work in progress: availability only so far)."""

from __future__ import annotations

import functools


@functools.cache
def _import_error() -> str:
    try:
        import mooncake.engine  # noqa: F401
    except Exception as e:  # ImportError, or a missing libibverbs
        return f"{type(e).__name__}: {e}"
    return ""


def available() -> bool:
    return _import_error() == ""


def unavailable_reason() -> str:
    return (f"cannot import mooncake.engine ({_import_error()}); install mooncake-transfer-engine (CUDA hosts) or "
            "mooncake-transfer-engine-non-cuda plus libibverbs1")


def advertise() -> tuple[str, str]:
    """(session, protocol) this process offers to senders; ("", "") without Mooncake."""
    return "", ""
