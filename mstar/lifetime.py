"""Processes that end with the process that started them.

A launcher (``mstar serve``) killed with SIGKILL runs no cleanup: without help its services
would live on under PID 1, holding their ports and shared memory. On Linux each child asks the
kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``), in the child between fork
and exec (``preexec_fn``), so that it covers every kind of service (Python or not). A service
stops cleanly on SIGTERM: it drains, closes its links, and its senders unlink their shared-memory
segments. Elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when this process dies.
    Everything is looked up here, in the parent: the child only makes two system calls."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request took hold
            os._exit(1)
    return preexec

