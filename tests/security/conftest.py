"""One launcher mesh for the security tests of the session (security_mesh.py)."""

from __future__ import annotations

import pytest
from security_mesh import MAX_INFLIGHT, start_mesh


@pytest.fixture(scope="session")
def mesh():
    m = start_mesh("--max-inflight", str(MAX_INFLIGHT), "--timeout", "60")
    try:
        yield m
    finally:
        code = m.launcher.stop()
    assert code == 0, f"launcher exited {code}: {m.log()}"
