"""mstar.lifetime: a service started with ``lifetime.child_env()`` in its environment dies with
the process that started it (its ``adopt()`` asks the kernel for SIGTERM then), without a
``preexec_fn`` in the parent."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from mstar import lifetime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
ADOPT = "import os; from mstar import lifetime; lifetime.adopt(); "


def test_adopt_consumes_the_variable_and_refuses_a_parent_that_is_not_its_own():
    mine = subprocess.run([sys.executable, "-c", ADOPT + "print(os.environ.get('MSTAR_PARENT_PID'))"],
                          env={**os.environ, **lifetime.child_env()}, capture_output=True, text=True, timeout=60)
    assert mine.returncode == 0 and mine.stdout.strip() == "None", mine.stderr  # its own children get their own
    gone = subprocess.run([sys.executable, "-c", ADOPT + "print('ran')"], env={**os.environ, "MSTAR_PARENT_PID": "1"},
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and gone.stdout == ""  # the parent named is not there any more: exit at once


def test_an_adopted_child_dies_with_a_sigkilled_parent():
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time; from mstar import lifetime; "
        "c = subprocess.Popen([sys.executable, '-c', " + repr(ADOPT + "print('up', flush=True); import time; "
                                                             "time.sleep(120)") + "], "
        "env={**os.environ, **lifetime.child_env()}, stdout=subprocess.PIPE, text=True); "
        "assert c.stdout.readline() == 'up\\n'; print(c.pid, flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{child}"):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{child}"), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
