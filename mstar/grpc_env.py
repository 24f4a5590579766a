"""gRPC core settings the M* services run with. They are read from the environment when
``grpc`` is first imported, so each service's ``__main__`` calls ``apply()`` before any
import that pulls grpc in. A value the operator set in the environment wins.

``GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener``: grpc 1.85 serves TCP
through its EventEngine endpoints by default; its older iomgr endpoints cost less CPU per
message on our traffic (many small messages on long-lived streams, and a Python asyncio
poller). On the mesh benchmark (bench/results/README.md, same code and session with and
without): 21% more requests/s at 64 clients, 67% at 16, 16% lower p50 at one client; served
Orpheus on an H100 did not move (bench/results/orpheus/README.md). If a grpc
release drops these experiments it logs "Unknown experiment" at start: measure again then.
"""

from __future__ import annotations

import os

DEFAULTS = {"GRPC_EXPERIMENTS": "-event_engine_client,-event_engine_listener"}


def apply() -> None:
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
