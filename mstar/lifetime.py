"""Processes that end with the process that started them.

A launcher (``mstar serve``) killed with SIGKILL runs no cleanup: without help its services
would live on under PID 1, holding their ports and shared memory. On Linux each service asks the
kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``). A service stops cleanly
on SIGTERM: it drains, closes its links, and its senders unlink their shared-memory segments.

The request is made by the service itself, first thing in its ``__main__`` (``adopt``), not
between fork and exec (``preexec_fn``): a ``preexec_fn`` makes ``subprocess`` use a real
``fork()``, which runs gRPC core's fork handlers, and in a process with gRPC channels open (the
launcher's health checks, a node group's servers) those can deadlock the parent in the fork, or
the child before it execs (a start hung for good on the CI machine). Without one, ``subprocess``
uses ``vfork``, which runs no fork handlers. The parent passes its pid in ``MSTAR_PARENT_PID``;
a child whose parent already died before the request took hold exits at once. A death
signal survives ``exec``, so a wrapper that execs another program (the Envoy front proxy) hands
it on. Elsewhere than Linux this is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PARENT_ENV = "MSTAR_PARENT_PID"


def child_env() -> dict[str, str]:
    """What a child's environment adds so that its ``adopt()`` ties it to this process."""
    return {PARENT_ENV: str(os.getpid())}


def adopt() -> None:
    """Die (SIGTERM) with the parent named in ``MSTAR_PARENT_PID``; exit now if it is already
    gone. The variable is consumed: this process's own children get their own."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if str(os.getppid()) != parent:  # the parent died before the request took hold
        os._exit(1)
