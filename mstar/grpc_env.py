"""gRPC core settings the M* services run with. They are read from the environment when
``grpc`` is first imported, so each service's ``__main__`` calls ``apply()`` before any
import that pulls grpc in. A value the operator set in the environment wins.

``GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener``: grpc 1.85 serves TCP
through its EventEngine endpoints by default; its older iomgr endpoints cost less CPU per
message on our traffic (many small messages on long-lived streams, and a Python asyncio
poller). On the mesh benchmark (bench/results/README.md) they gave 12–22% more requests/s
at 64 clients and ~10% lower latency at one client, same run, same machine. If a grpc
release drops these experiments it logs "Unknown experiment" at start: measure again then.
"""

from __future__ import annotations

import os

DEFAULTS = {"GRPC_EXPERIMENTS": "-event_engine_client,-event_engine_listener"}


def apply() -> None:
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
