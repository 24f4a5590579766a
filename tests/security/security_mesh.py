"""Starting and stopping launcher meshes (``mstar serve toy`` as a user starts it: real processes
on uvloop, where the NaN timeout failed) for the security tests."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from helpers import stop_process

READY = re.compile(r"M\* ready: model '(\w+)' at (http://[\d.:]+) \(gRPC ([\d.:]+);")
METRICS = re.compile(r"M\* metrics: (\{.*\})")
START_TIMEOUT_S = 60.0
REPO = Path(__file__).resolve().parents[2]
MAX_INFLIGHT = 8  # small: a leaked admission slot shows within a few requests


@dataclass
class Mesh:
    proc: subprocess.Popen
    url: str  # the gateway
    grpc: str  # the conductor, host:port
    metrics: dict[str, str]  # service -> its /metrics URL
    prefix: str  # the shared-memory prefix
    log_path: str

    def log(self, n: int = 3000) -> str:
        return Path(self.log_path).read_text(errors="replace")[-n:]


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def start_mesh(*args: str) -> Mesh:
    prefix = f"mstar-sec-{uuid.uuid4().hex[:12]}-"
    log = tempfile.NamedTemporaryFile("w", prefix="mstar-security-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "mstar.cli", "serve", "toy", "--port", "0", "--grpc-port", "0",
                             "--log-level", "WARNING", "--socket-path-prefix", prefix, *args],
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    ready = None
    try:
        while True:
            line = lines.get(timeout=START_TIMEOUT_S)
            if line is None:
                raise AssertionError(f"launcher exited {proc.wait(5)}: {Path(log.name).read_text()[-3000:]}")
            ready = ready or READY.search(line)
            m = METRICS.search(line)
            if ready and m:
                return Mesh(proc, ready.group(2), ready.group(3), json.loads(m.group(1)), prefix, log.name)
    except queue.Empty:
        stop_mesh(proc)
        raise AssertionError(f"no ready line within {START_TIMEOUT_S:g} s: {Path(log.name).read_text()[-3000:]}") from None


def stop_mesh(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after 30 s; the launcher's exit code."""
    return stop_process(proc, timeout=30)
