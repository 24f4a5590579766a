"""Starting launcher meshes (``mstar serve MODEL`` as a user starts it, on free ports) for the client
tests: conftest.py's shared toy mesh and the robot models' own (test_sdk_robot.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from helpers import READY, LauncherProcess

START_TIMEOUT_S = 60.0


@dataclass
class Mesh:
    launcher: LauncherProcess
    #: the gateway, e.g. http://127.0.0.1:41697
    url: str
    #: the conductor, host:port
    grpc: str

    @property
    def proc(self):
        return self.launcher.proc

    @property
    def grpc_url(self) -> str:
        return f"grpc://{self.grpc}"

    def stderr_tail(self, n: int = 3000) -> str:
        return self.launcher.stderr(n)


def start_mesh(model: str = "toy", *args: str) -> Mesh:
    """``mstar serve MODEL ARGS`` (e.g. ``--random-weights --cache-dir DIR``) on free ports."""
    launcher = LauncherProcess("serve", model, *args, "--port", "0", "--grpc-port", "0", "--log-level", "WARNING")
    return launcher.wait_lines(lambda line: (m := READY.search(line)) and Mesh(launcher, m.group(2), m.group(3)),
                               START_TIMEOUT_S, "its ready line")


@contextlib.contextmanager
def served(model: str = "toy", *args: str):
    """A launcher mesh for the block; it must stop cleanly (exit 0) after it."""
    m = start_mesh(model, *args)
    try:
        yield m
    finally:
        code = m.launcher.stop()
    assert code == 0, f"launcher exited {code}: {m.stderr_tail()}"
