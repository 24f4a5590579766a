"""NVTX ranges (mstar serve --enable-nvtx): pushed and popped in balance, per thread, on every path
(success, a node that fails, an engine step that fails, cancellation); none while off."""

import threading

import grpc
import pytest
from test_engine_node import CFG as COUNTER
from test_engine_node import req as counter_request

from mstar import nvtx

from helpers import collect, request, run, wait_released
from inprocess import inprocess_mesh


class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.names: list[str] = []
        self.depth: dict[int, int] = {}
        self.negative = False

    def push(self, name):
        with self.lock:
            self.names.append(name)
            t = threading.get_ident()
            self.depth[t] = self.depth.get(t, 0) + 1

    def pop(self):
        with self.lock:
            t = threading.get_ident()
            self.depth[t] = self.depth.get(t, 0) - 1
            self.negative |= self.depth[t] < 0

    def balanced(self) -> bool:
        return not self.negative and all(d == 0 for d in self.depth.values())


@pytest.fixture
def ranges():
    rec = Recorder()
    nvtx.configure(True, rec.push, rec.pop)
    yield rec
    nvtx.configure(False)


def test_ranges_balance_on_every_path(toy_config, ranges):
    async def go():
        async with inprocess_mesh(toy_config("default")) as mesh:
            await collect(mesh.stub, request("Hello", max_tokens=8))
            with pytest.raises(grpc.aio.AioRpcError):
                await collect(mesh.stub, request("Hello", fail_at=2))
            call = mesh.stub.Generate(request("A longer text to cancel.", request_id="nv", delay_ms=20), timeout=20)
            await call.read()
            call.cancel()
            await wait_released(mesh)
        async with inprocess_mesh(COUNTER) as mesh:
            await collect(mesh.stub, counter_request(1, n=4))
            with pytest.raises(grpc.aio.AioRpcError):
                await collect(mesh.stub, counter_request(2, n=5, explode_at=2))
    run(go(), timeout=60)
    assert ranges.balanced(), ranges.depth
    names = set(ranges.names)
    assert {"encode/rot x1", "generate/decoder x1", "lm engine step"} <= names
    assert any(n.startswith("send text_state -> decoder") for n in names)
    assert any(n.startswith("receive ") and n.endswith("from encoder") for n in names)


def test_no_ranges_while_off(toy_config):
    assert not nvtx.ACTIVE and nvtx.span("x") is nvtx.NULL

    async def go():
        async with inprocess_mesh(toy_config("colocated")) as mesh:
            await collect(mesh.stub, request("Hi"))
    run(go(), timeout=30)
    assert nvtx.span("x") is nvtx.NULL


def test_enabling_without_cuda_says_why():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: enabling succeeds")
    with pytest.raises(RuntimeError, match="--enable-nvtx needs a CUDA build of torch"):
        nvtx.configure(True)
    assert not nvtx.ACTIVE
