"""The runtime drives EngineNode submodules through submit/step: calls of many
requests share engine steps, and release frees what the engine holds."""

import asyncio

import grpc
import pytest
import torch

from mstar import wire
from mstar.config import parse_config
from mstar.models.base import EngineNode, InvalidArgument, Model, Output, RequestState, WalkSeed
from mstar.models.graph import EMIT_TO_CLIENT, INPUT, EngineType, GraphEdge, GraphNode, Loop, Modality, Walk
from mstar.models.registry import register
from mstar.testing import inprocess_mesh
from mstar.v1 import conductor_pb2 as cpb

from helpers import collect, run, wait_released

ENGINES: list["CountingEngine"] = []


class CountingEngine(EngineNode):
    """Each call needs `work` steps (first call of a request: 3, like a chunked prefill;
    later ones: 1). Every step advances every pending call: continuous batching."""

    blocking = False

    def __init__(self):
        self.pending: dict[str, list] = {}  # request -> [call, steps left]
        self.batch_sizes: list[int] = []
        ENGINES.append(self)

    def submit(self, call):
        assert call.request_id not in self.pending
        self.pending[call.request_id] = [call, 3 if call.iteration == 0 else 1]

    @property
    def has_work(self):
        return bool(self.pending)

    def step(self):
        self.batch_sizes.append(len(self.pending))
        done = []
        for rid, entry in list(self.pending.items()):
            entry[1] -= 1
            if entry[1] == 0:
                call = entry[0]
                del self.pending[rid]
                if call.kwargs.get("explode_at") == call.iteration:
                    done.append((call, RuntimeError("engine exploded")))
                    continue
                done.append((call, {"tok": torch.tensor([call.iteration * 10 + int(call.inputs["seed"])])}))
        return done

    def check_stop(self, call, outputs):
        return call.iteration + 1 >= call.kwargs["n"]

    def release(self, request_id):
        self.pending.pop(request_id, None)


class Counter(Model):
    name = "counter"
    nodes = (GraphNode("lm", EngineType.KV_CACHE),)

    def build_walks(self):
        return [Walk("decode", Loop("lm", 100, stop_node="lm"), [
            GraphEdge(INPUT, "lm", "seed"), GraphEdge("lm", EMIT_TO_CLIENT, "tok", modality=Modality.LATENT)])]

    def validate_kwargs(self, kwargs):
        if not isinstance(kwargs.get("n"), int):
            raise InvalidArgument("model_kwargs.n", "required integer")
        return kwargs

    def process_prompt(self, prompt):
        return RequestState(prompt)

    def next_walk(self, state, finished):
        return WalkSeed("decode", {"seed": torch.tensor([int(state.prompt.text)])}) if finished is None else None

    def postprocess(self, state, emit):
        return [Output("tok", Modality.LATENT, tensor=emit.tensor)]

    def create_submodule(self, ctx):
        return CountingEngine()


register("counter", f"{__name__}:Counter")
CFG = parse_config({"model": "counter", "node_groups": [{"name": "lm", "node_names": ["lm"]}]})


def req(seed, **kw):
    import json
    return cpb.GenerateRequest(model="counter", text=str(seed), model_kwargs_json=json.dumps(kw))


@pytest.mark.parametrize("blocking", [False, True], ids=["on-the-loop", "engine-thread"])
def test_engine_node_batches_across_requests_and_releases(blocking, monkeypatch):
    monkeypatch.setattr(CountingEngine, "blocking", blocking)  # True: it steps on the node group's engine thread
    ENGINES.clear()

    async def go():
        async with inprocess_mesh(CFG) as mesh:
            res = await asyncio.gather(*(collect(mesh.stub, req(s, n=5)) for s in range(6)))
            for s, (out, _final) in enumerate(res):
                assert [wire.from_proto(c.tensor).item() for c in out["tok"]] == [i * 10 + s for i in range(5)]
            engine = ENGINES[-1]
            assert max(engine.batch_sizes) > 1  # requests shared steps
            # a failing call fails only its request
            bad, good = await asyncio.gather(collect(mesh.stub, req(1, n=5, explode_at=2)), collect(mesh.stub, req(2, n=3)),
                                             return_exceptions=True)
            assert isinstance(bad, grpc.aio.AioRpcError) and "engine exploded" in bad.details()
            assert len(good[0]["tok"]) == 3
            # cancel mid-loop: the engine holds nothing afterwards
            call = mesh.stub.Generate(req(3, n=100), timeout=10)
            await call.read()
            call.cancel()
            await wait_released(mesh)
            for _ in range(100):  # engine releases happen between engine steps
                if not engine.pending:
                    break
                await asyncio.sleep(0.01)
            assert engine.pending == {} and mesh.runtime("lm")._in_engine == {}
    run(go())


def test_engine_node_rejects_forward():
    with pytest.raises(TypeError, match="submit/step"):
        CountingEngine().forward([])
