"""One real mesh for every client test: ``python -m mstar.cli serve toy`` on free ports, as a
user starts it (tests/e2e does the same); the clients talk real HTTP and gRPC to it on loopback.
Shared by the modules (one start instead of three, ~10 s each on the 2-core CI machine): every
test sends its own requests and none changes the mesh; it must still exit 0 at the end."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import stop_process

READY = re.compile(r"M\* ready: model '(\w+)' at (http://[\d.:]+) \(gRPC ([\d.:]+);")
START_TIMEOUT_S = 60.0
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Mesh:
    proc: subprocess.Popen
    #: the gateway, e.g. http://127.0.0.1:41697
    url: str
    #: the conductor, host:port
    grpc: str
    stderr_path: str

    @property
    def grpc_url(self) -> str:
        return f"grpc://{self.grpc}"

    def stderr_tail(self, n: int = 3000) -> str:
        return Path(self.stderr_path).read_text(errors="replace")[-n:]


def _pump(stream, lines: queue.Queue) -> None:
    """Read the launcher's stdout to the end so that it never blocks on a full pipe."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def start_mesh(model: str = "toy", *args: str) -> Mesh:
    """``mstar serve MODEL ARGS`` (e.g. ``--random-weights --cache-dir DIR``) on free ports."""
    err = tempfile.NamedTemporaryFile("w", prefix="mstar-clients-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "mstar.cli", "serve", model, *args, "--port", "0", "--grpc-port",
                             "0", "--log-level", "WARNING"], stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=START_TIMEOUT_S)
            if line is None:
                raise AssertionError(f"launcher exited {proc.wait(5)} before it was ready: "
                                     f"{Path(err.name).read_text()[-3000:]}")
            m = READY.search(line)
            if m:
                return Mesh(proc, m.group(2), m.group(3), err.name)
    except queue.Empty:
        stop_mesh(proc)
        raise AssertionError(f"no ready line within {START_TIMEOUT_S:g} s: {Path(err.name).read_text()[-3000:]}") from None


def stop_mesh(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after 30 s; the launcher's exit code."""
    return stop_process(proc, timeout=30)


@contextlib.contextmanager
def served(model: str = "toy", *args: str):
    """A launcher mesh for the block; it must stop cleanly (exit 0) after it."""
    m = start_mesh(model, *args)
    try:
        yield m
    finally:
        code = stop_mesh(m.proc)
        log = m.stderr_tail()
        os.unlink(m.stderr_path)
    assert code == 0, f"launcher exited {code}: {log}"


@pytest.fixture(scope="session")
def mesh():
    with served() as m:
        yield m
