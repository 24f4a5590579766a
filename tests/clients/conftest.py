"""One real mesh for every client test: ``python -m mstar.cli serve toy`` on free ports, as a
user starts it (tests/e2e does the same); the clients talk real HTTP and gRPC to it on loopback.
Shared by the modules (one start instead of three, ~10 s each on the 2-core CI machine): every
test sends its own requests and none changes the mesh; it must still exit 0 at the end."""

from __future__ import annotations

import pytest
from clients_mesh import served


@pytest.fixture(scope="session")
def mesh():
    with served() as m:
        yield m
