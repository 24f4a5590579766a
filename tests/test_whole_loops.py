"""Whole loops: a LoopBodyNode's fixed-count Loop runs every iteration in one call per batch of
requests (LoopGraphs; eager on this CPU, one CUDA graph per bucket on a GPU: see
tests/engines/test_loop_graph.py), and the values that leave it are exactly the per-iteration
loop's."""

import asyncio
import json

import pytest
import torch

from mstar import wire
from mstar.config import Placement, parse_config
from mstar.models.base import LoopBodyNode, Model, NodeSubmodule, Output, RequestState, WalkSeed
from mstar.models.graph import EMIT_TO_CLIENT, INPUT, GraphEdge, GraphNode, Loop, Modality, Sequential, Walk
from mstar.models.registry import register
from mstar.services.node_group.runtime import NodeGroupRuntime
from mstar.services.transport import Protocol
from mstar.v1 import conductor_pb2 as cpb

from helpers import collect, run
from inprocess import inprocess_mesh

STEPS, DIM = 10, 6
W = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(0)) / DIM**0.5


def euler(x, cond, i, w=W):
    t = 1.0 - i / STEPS
    return x - (1.0 / STEPS) * torch.tanh(x @ w + cond * t)


class Prep(NodeSubmodule):
    def forward(self, calls):
        out = []
        for c in calls:
            g = torch.Generator().manual_seed(int(c.inputs["seed"]))
            out.append({"x": torch.randn(3, DIM, generator=g), "cond": torch.randn(DIM, generator=g)})
        return out


class Euler(LoopBodyNode):
    calls = 0

    def __init__(self):
        self.w = W.to(self.device)  # on the device before any capture, as a model's weights are

    def step(self, inputs, iteration):
        Euler.calls += 1
        return {"x": euler(inputs["x"], inputs["cond"][:, None, :], iteration, self.w)}


class Out(NodeSubmodule):
    def forward(self, calls):
        return [{"actions": c.inputs["x"].cpu() * 2} for c in calls]


class Flow(Model):
    name = "flow-test"
    nodes = (GraphNode("prep"), GraphNode("euler"), GraphNode("out"))
    loop_kw: dict = {}

    def build_walks(self):
        return [Walk("sample", Sequential("prep", Loop("euler", STEPS, name="flow", **self.loop_kw), "out"), [
            GraphEdge(INPUT, "prep", "seed"), GraphEdge("prep", "euler", "x"), GraphEdge("prep", "euler", "cond"),
            GraphEdge("euler", "euler", "x"), GraphEdge("euler", "out", "x"),
            GraphEdge("out", EMIT_TO_CLIENT, "actions", modality=Modality.ACTION)])]

    def validate_kwargs(self, kwargs):
        return kwargs

    def process_prompt(self, prompt):
        return RequestState(prompt)

    def next_walk(self, state, finished):
        return WalkSeed("sample", {"seed": torch.tensor([int(state.prompt.text)])}) if finished is None else None

    def postprocess(self, state, emit):
        return [Output("actions", Modality.ACTION, tensor=emit.tensor)]

    def create_submodule(self, ctx):
        return {"prep": Prep, "euler": Euler, "out": Out}[ctx.node]()


register("flow-test", f"{__name__}:Flow")


def expected(seed: int) -> torch.Tensor:
    (prep,) = Prep().forward([type("C", (), {"inputs": {"seed": torch.tensor([seed])}})()])
    x = prep["x"]
    for i in range(STEPS):
        x = euler(x, prep["cond"], i)
    return x * 2


@pytest.mark.parametrize("groups", [[["prep", "euler", "out"]], [["prep", "out"], ["euler"]]],
                         ids=["colocated", "loop-on-its-own-group"])
def test_whole_loop_gives_the_per_iteration_result_in_one_call_per_batch(groups):
    cfg = parse_config({"model": "flow-test", "node_groups": [{"name": f"g{i}", "node_names": g}
                                                              for i, g in enumerate(groups)]})

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            Euler.calls = 0
            reqs = [cpb.GenerateRequest(model="flow-test", text=str(s), model_kwargs_json=json.dumps({})) for s in range(6)]
            res = await asyncio.gather(*(collect(mesh.stub, r) for r in reqs))
            for s, (out, _final) in enumerate(res):
                got = wire.from_proto(out["actions"][0].tensor)
                torch.testing.assert_close(got, expected(s), rtol=1e-5, atol=1e-6)
            group = next(g for g, s in mesh.groups.items() if "euler" in s.runtime.submodules)
            loops = mesh.runtime(group).nodes.whole_loops.loops[("sample", "euler")]
            runs = loops.stats.eager_runs  # on this CPU every batch runs eagerly, all its iterations in one call
            assert 1 <= runs <= 6 and loops.stats.graph_replays == 0
            assert Euler.calls == runs * STEPS  # each run: every iteration, for the whole batch
    run(go(), timeout=60)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the whole loop as a CUDA graph replay)")
def test_whole_loop_on_cuda_is_a_graph_replay(monkeypatch):
    monkeypatch.setattr(Euler, "device", "cuda")
    cfg = parse_config({"model": "flow-test", "node_groups": [{"name": "g", "node_names": ["prep", "euler", "out"]}]})

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            for n in (1, 3, 6):  # batches of up to 6 requests: buckets 1, 2, 4, 8
                reqs = [cpb.GenerateRequest(model="flow-test", text=str(s), model_kwargs_json="{}") for s in range(n)]
                res = await asyncio.gather(*(collect(mesh.stub, r) for r in reqs))
                for s, (out, _final) in enumerate(res):
                    got = wire.from_proto(out["actions"][0].tensor)
                    torch.testing.assert_close(got, expected(s), rtol=1e-4, atol=1e-5)  # fp32 on the GPU
            loops = mesh.runtime("g").nodes.whole_loops.loops[("sample", "euler")]
            assert loops.stats.eager_runs == 0 and loops.stats.graph_replays >= 3 and 1 <= loops.num_graphs <= 4
    run(go(), timeout=120)


@pytest.mark.parametrize("loop_kw, why", [({"stop_node": "euler"}, "has a stop_node"),
                                           ({"accumulate": frozenset({"x"})}, "accumulates")])
def test_a_loop_that_cannot_run_whole_is_refused_at_start(monkeypatch, loop_kw, why):
    monkeypatch.setattr(Flow, "loop_kw", loop_kw)
    cfg = parse_config({"model": "flow-test", "node_groups": [{"name": "g", "node_names": ["prep", "euler", "out"]}]})
    model = Flow()
    with pytest.raises(ValueError, match=f"node 'euler' is a LoopBodyNode, but its loop 'flow' {why}"):
        NodeGroupRuntime("g", model, Placement(cfg, model), {}, "127.0.0.1:1", Protocol.TCP)


class Warm(Euler):
    graph_buckets = (1, 2, 4)

    def __init__(self):
        pass  # no weights moved: this test never runs the body

    def example_inputs(self):
        return {"x": torch.zeros(3, DIM), "cond": torch.zeros(DIM)}


@pytest.mark.parametrize("node, warmed", [(Warm, True), (Euler, False)], ids=["example-inputs", "none"])
def test_a_loop_with_example_inputs_is_warmed_at_start(monkeypatch, node, warmed):
    from mstar.services.node_group import whole_loops

    examples = []
    monkeypatch.setattr(whole_loops.LoopGraphs, "warm", lambda self, example: examples.append((self.buckets, example)))
    cfg = parse_config({"model": "flow-test", "node_groups": [{"name": "g", "node_names": ["prep", "euler", "out"]}]})
    model = Flow()
    Placement(cfg, model)
    whole_loops.WholeLoops(model, {"sample": ("prep", "euler", "out")}, {"prep": Prep(), "euler": node(), "out": Out()})
    if warmed:
        ((buckets, example),) = examples
        assert buckets == Warm.graph_buckets and {k: v.shape for k, v in example.items()} == {"x": (3, DIM), "cond": (DIM,)}
    else:
        assert examples == []
