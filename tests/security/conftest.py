"""One launcher mesh for the security tests of the session (security_mesh.py)."""

from __future__ import annotations

import os

import pytest
from security_mesh import MAX_INFLIGHT, start_mesh, stop_mesh


@pytest.fixture(scope="session")
def mesh():
    m = start_mesh("--max-inflight", str(MAX_INFLIGHT), "--timeout", "60")
    try:
        yield m
    finally:
        code = stop_mesh(m.proc)
        log = m.log()
        os.unlink(m.log_path)
    assert code == 0, f"launcher exited {code}: {log}"
