"""Graph shapes through real node-group services, colocated and over three groups: a value fanned out
to two nodes of a Parallel, a value persisted to two nodes of a later walk, a Loop without a stop
node (it runs max_iters) carrying a walk input."""

import pytest
import torch

from mstar import wire
from mstar.config import parse_config
from mstar.models.base import WalkSeed
from mstar.models.graph import (
    EMIT_TO_CLIENT,
    INPUT,
    GraphEdge,
    GraphNode,
    Loop,
    Modality,
    Parallel,
    Sequential,
    Walk,
)
from mstar.models.registry import register
from mstar.v1 import conductor_pb2 as cpb

from helpers import Fn, TensorModel, collect, run, wait_released
from inprocess import inprocess_mesh


class Shapes(TensorModel):
    name = "shapes"
    nodes = tuple(GraphNode(n) for n in "abcde")

    def build_walks(self):
        return [
            Walk("one", Sequential("a", Parallel("b", "c")), [
                GraphEdge(INPUT, "a", "n"), GraphEdge("a", "b", "x"), GraphEdge("a", "c", "x"),
                GraphEdge("a", "d", "keep", persist=True), GraphEdge("a", "e", "keep", persist=True),
                GraphEdge("b", EMIT_TO_CLIENT, "bs", modality=Modality.LATENT),
                GraphEdge("c", EMIT_TO_CLIENT, "cs", modality=Modality.LATENT)]),
            Walk("two", Sequential(Loop("d", 4), "e"), [  # no stop node: max_iters
                GraphEdge(INPUT, "d", "keep"), GraphEdge(INPUT, "e", "keep"), GraphEdge("d", "d", "keep"),
                GraphEdge("d", "e", "dd"), GraphEdge("e", EMIT_TO_CLIENT, "es", modality=Modality.LATENT)]),
        ]

    def next_walk(self, s, f):
        return {None: WalkSeed("one", {"n": torch.tensor([int(s.prompt.text)])}), "one": WalkSeed("two")}.get(f)

    def create_submodule(self, ctx):
        return {"a": Fn(lambda c: {"x": c.inputs["n"] * 2, "keep": c.inputs["n"] + 100}),
                "b": Fn(lambda c: {"bs": c.inputs["x"] + 1}),
                "c": Fn(lambda c: {"cs": c.inputs["x"] + 2}),
                "d": Fn(lambda c: {"keep": c.inputs["keep"] + 1, "dd": c.inputs["keep"]}),
                "e": Fn(lambda c: {"es": c.inputs["dd"] * 1000 + c.inputs["keep"]})}[ctx.node]


register("shapes", f"{__name__}:Shapes")


@pytest.mark.parametrize("groups", [
    [{"name": "g", "node_names": list("abcde")}],
    [{"name": "g1", "node_names": ["a", "b"]}, {"name": "g2", "node_names": ["c", "d"]}, {"name": "g3", "node_names": ["e"]}],
])
def test_fan_out_persist_to_two_nodes_and_a_loop_without_stop_node(groups):
    cfg = parse_config({"model": "shapes", "node_groups": groups})

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            out, final = await collect(mesh.stub, cpb.GenerateRequest(model="shapes", text="5"), timeout=20)
            vals = {k: [wire.from_proto(c.tensor).tolist() for c in v] for k, v in out.items()}
            assert vals["bs"] == [[11]] and vals["cs"] == [[12]]
            assert vals["es"] == [[108 * 1000 + 105]]  # d ran 4 times (keep 105 -> 108), e read the persisted 105
            await wait_released(mesh)
    run(go())
