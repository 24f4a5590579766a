"""Issue 49, hole 7: a ``timeout_s`` below the smallest one kept (MIN_TIMEOUT_S, 1 ms) is the client's
error, INVALID_ARGUMENT naming ``timeout_s``, at the conductor too: 5e-324 was taken and ended as
DEADLINE_EXCEEDED, the server's fault by its code. (The gateway's 400: tests/gateway/test_gateway_bounds.py.)"""

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from mstar import untrusted
from mstar.limits import MIN_TIMEOUT_S

from helpers import collect, request, run
from inprocess import inprocess_mesh


@pytest.mark.parametrize("value", [5e-324, 1e-9, MIN_TIMEOUT_S / 2])
def test_check_timeout_refuses_below_the_smallest(value):
    with pytest.raises(untrusted.Untrusted, match="below the smallest timeout, 0.001 s"):
        untrusted.check_timeout(value, 300.0)


@pytest.mark.parametrize("value", [0.0, MIN_TIMEOUT_S, 1.5, 300.0])
def test_check_timeout_takes_the_default_and_the_range(value):
    untrusted.check_timeout(value, 300.0)


def _field(error: grpc.aio.AioRpcError) -> str:
    for detail in rpc_status.from_call(error).details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            return bad.field_violations[0].field
    return ""


def test_the_conductor_answers_invalid_argument_naming_timeout_s(toy_config):
    async def go():
        async with inprocess_mesh(toy_config()) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(mesh.stub, request("hi", timeout_s=5e-324))
            ok = await collect(mesh.stub, request("hi", timeout_s=5.0))
            return e.value, ok

    error, ok = run(go())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert _field(error) == "timeout_s" and "timeout_s" in error.details()
    assert ok is not None  # a real timeout still runs
