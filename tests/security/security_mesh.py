"""Starting and stopping launcher meshes (``mstar serve toy`` as a user starts it: real processes
on uvloop, where the NaN timeout failed) for the security tests."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from helpers import METRICS, READY, LauncherProcess

START_TIMEOUT_S = 60.0
MAX_INFLIGHT = 8  # small: a leaked admission slot shows within a few requests


@dataclass
class Mesh:
    launcher: LauncherProcess
    url: str  # the gateway
    grpc: str  # the conductor, host:port
    metrics: dict[str, str]  # service -> its /metrics URL
    prefix: str  # the shared-memory prefix

    @property
    def proc(self):
        return self.launcher.proc

    def log(self, n: int = 3000) -> str:
        return self.launcher.stderr(n)


def start_mesh(*args: str, env: dict[str, str] | None = None) -> Mesh:
    prefix = f"mstar-sec-{uuid.uuid4().hex[:12]}-"
    launcher = LauncherProcess("serve", "toy", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING",
                               "--socket-path-prefix", prefix, *args, env=env)
    ready = []

    def handle(line: str) -> Mesh | None:
        if m := READY.search(line):
            ready.append(m)
        elif ready and (m := METRICS.search(line)):
            return Mesh(launcher, ready[0].group(2), ready[0].group(3), json.loads(m.group(1)), prefix)
        return None

    return launcher.wait_lines(handle, START_TIMEOUT_S)

