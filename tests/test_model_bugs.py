"""A bug in a model's code fails that request with INTERNAL saying what went wrong, wherever it
happens, and the services go on serving: conductor side (validate / process_prompt, the state
machine at a request's start or later, postprocess) and node side (outputs of the wrong type, a
chunk walk failing on its first, a middle or its last chunk, a bug the runtime loop itself hits)."""

import grpc
import pytest
import torch

from mstar import wire
from mstar.config import parse_config
from mstar.models.base import WalkSeed
from mstar.models.graph import (
    EMIT_TO_CLIENT,
    INPUT,
    FixedChunks,
    GraphEdge,
    GraphNode,
    Loop,
    Modality,
    PartitionTopology,
    Sequential,
    StreamingGraphEdge,
    Walk,
)
from mstar.models.registry import register
from mstar.v1 import conductor_pb2 as cpb

from helpers import Fn, TensorModel, collect, run, wait_released
from inprocess import inprocess_mesh


class Buggy(TensorModel):
    """Fails where the prompt says."""

    name = "buggy"
    nodes = (GraphNode("a"),)

    def build_walks(self):
        return [Walk("w", "a", [GraphEdge(INPUT, "a", "n"), GraphEdge("a", EMIT_TO_CLIENT, "y", modality=Modality.LATENT)])]

    def process_prompt(self, prompt):
        if prompt.text == "prompt":
            raise KeyError("boom in process_prompt")
        return super().process_prompt(prompt)

    def next_walk(self, state, finished):
        text = state.prompt.text
        if text == "first":
            raise RuntimeError("boom in next_walk")
        if text == "unknown walk":
            return WalkSeed("nope")
        if text == "later" and finished == "w":
            raise RuntimeError("boom later")
        return WalkSeed("w", {"n": torch.tensor([1])}) if finished is None else None

    def postprocess(self, state, emit):
        if state.prompt.text == "post":
            raise ValueError("boom in postprocess")
        return super().postprocess(state, emit)

    def create_submodule(self, ctx):
        return Fn(lambda c: {"y": c.inputs["n"]})


register("buggy", f"{__name__}:Buggy")


def test_conductor_side_model_bugs_fail_their_request_with_internal():
    cfg = parse_config({"model": "buggy", "node_groups": [{"name": "g", "node_names": ["a"]}]})
    cases = {"prompt": "KeyError: 'boom in process_prompt'", "first": "RuntimeError: boom in next_walk",
             "unknown walk": "RuntimeError: the state machine chose unknown walk 'nope'",
             "later": "RuntimeError: boom later", "post": "ValueError: boom in postprocess"}

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            for text, error in cases.items():
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(mesh.stub, cpb.GenerateRequest(model="buggy", text=text), timeout=10)
                assert e.value.code() == grpc.StatusCode.INTERNAL, text
                assert e.value.details() == f"model 'buggy' failed in the conductor: {error}"
            out, _ = await collect(mesh.stub, cpb.GenerateRequest(model="buggy", text="fine"), timeout=10)
            assert list(out) == ["y"]
            await wait_released(mesh)
    run(go())


def a_outputs(call):
    return {"int": {"x": 5}, "list": [torch.tensor([1])]}.get(call.kwargs.get("mode"), {"x": torch.tensor([1])})


class WrongOutputs(TensorModel):
    name = "wrong_outputs"
    nodes = (GraphNode("a"), GraphNode("b"))

    def build_walks(self):
        return [Walk("w", Sequential("a", "b"), [GraphEdge(INPUT, "a", "n"), GraphEdge("a", "b", "x"),
                                                 GraphEdge("b", EMIT_TO_CLIENT, "y", modality=Modality.LATENT)])]

    def next_walk(self, state, finished):
        return WalkSeed("w", {"n": torch.tensor([1])}) if finished is None else None

    def create_submodule(self, ctx):
        return Fn(a_outputs) if ctx.node == "a" else Fn(lambda c: {"y": c.inputs["x"]})


register("wrong_outputs", f"{__name__}:WrongOutputs")


@pytest.mark.parametrize("groups", [[["a", "b"]], [["a"], ["b"]]])
def test_node_outputs_of_the_wrong_type_fail_their_request_with_internal(groups):
    cfg = parse_config({"model": "wrong_outputs", "node_groups": [
        {"name": f"g{i}", "node_names": names} for i, names in enumerate(groups)]})
    cases = {"int": "node group 'g0': node 'a' returned output 'x' as int; outputs must be torch.Tensor",
             "list": "node group 'g0': node 'a' returned list for a call; a call's outputs are a dict of name -> torch.Tensor"}

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            for mode, message in cases.items():
                req = cpb.GenerateRequest(model="wrong_outputs", text="x", model_kwargs_json=f'{{"mode": "{mode}"}}')
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(mesh.stub, req, timeout=10)
                assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INTERNAL, message)
            out, _ = await collect(mesh.stub, cpb.GenerateRequest(model="wrong_outputs", text="x"), timeout=10)
            assert list(out) == ["y"]
            await wait_released(mesh)
    run(go())


def chunk_sum(call):
    items = call.inputs["item"]
    if int(items[0]) // 2 == call.kwargs.get("fail_chunk"):
        raise RuntimeError(f"chunk {int(items[0]) // 2} broke")
    return {"out": items.sum().reshape(1)}


class Streamy(TensorModel):
    """A 10-iteration loop streaming its items in chunks of 2 to a chunk walk; the chunk
    node fails on the chunk the request names."""

    name = "streamy"
    nodes = (GraphNode("p"), GraphNode("q"))

    def build_walks(self):
        return [Walk("gen", Loop("p", 10), [
                    GraphEdge(INPUT, "p", "i"), GraphEdge("p", "p", "i"),
                    StreamingGraphEdge("p", "q", "item", policy=FixedChunks(2), topology=PartitionTopology("gen", "chunk"))]),
                Walk("chunk", "q", [GraphEdge(INPUT, "q", "item"), GraphEdge("q", EMIT_TO_CLIENT, "out", modality=Modality.LATENT)])]

    def next_walk(self, state, finished):
        return WalkSeed("gen", {"i": torch.tensor([0])}) if finished is None else None

    def create_submodule(self, ctx):
        return Fn(lambda c: {"i": c.inputs["i"] + 1, "item": c.inputs["i"]}) if ctx.node == "p" else Fn(chunk_sum)


register("streamy", f"{__name__}:Streamy")


@pytest.mark.parametrize("groups", [[["p", "q"]], [["p"], ["q"]]])
def test_a_failing_chunk_walk_fails_its_request_and_releases_the_rest(groups):
    cfg = parse_config({"model": "streamy", "node_groups": [
        {"name": f"g{i}", "node_names": names} for i, names in enumerate(groups)]})
    where = f"g{len(groups) - 1}"

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            out, _ = await collect(mesh.stub, cpb.GenerateRequest(model="streamy", text="x"), timeout=10)
            assert [wire.from_proto(c.tensor).tolist() for c in out["out"]] == [[1], [5], [9], [13], [17]]
            for k in (0, 2, 4):  # first, middle, last chunk
                req = cpb.GenerateRequest(model="streamy", text="x", model_kwargs_json=f'{{"fail_chunk": {k}}}')
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(mesh.stub, req, timeout=10)
                assert e.value.code() == grpc.StatusCode.INTERNAL
                assert e.value.details() == f"node group '{where}': node 'q' failed: RuntimeError: chunk {k} broke"
            await wait_released(mesh)
    run(go())


class BrokenBatching(Fn):
    """A node whose batching knob raises while ``broken`` is set: the runtime loop itself hits
    the bug (choosing the next batch), outside any one request's routing."""

    broken = False

    @property
    def max_batch(self):
        if BrokenBatching.broken:
            raise RuntimeError("max_batch broke")
        return 8


class Batchy(TensorModel):
    name = "batchy"
    nodes = (GraphNode("a"),)

    def build_walks(self):
        return [Walk("w", "a", [GraphEdge(INPUT, "a", "n"), GraphEdge("a", EMIT_TO_CLIENT, "y", modality=Modality.LATENT)])]

    def next_walk(self, state, finished):
        return WalkSeed("w", {"n": torch.tensor([1])}) if finished is None else None

    def create_submodule(self, ctx):
        return BrokenBatching(lambda c: {"y": c.inputs["n"]})


register("batchy", f"{__name__}:Batchy")


def test_a_bug_in_the_runtime_loop_fails_its_requests_and_the_loop_goes_on():
    cfg = parse_config({"model": "batchy", "node_groups": [{"name": "g", "node_names": ["a"]}]})

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            BrokenBatching.broken = True
            try:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(mesh.stub, cpb.GenerateRequest(model="batchy", text="x"), timeout=10)
            finally:
                BrokenBatching.broken = False
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert e.value.details() == "node group 'g': the runtime loop failed: RuntimeError: max_batch broke"
            out, _ = await collect(mesh.stub, cpb.GenerateRequest(model="batchy", text="x"), timeout=10)
            assert list(out) == ["y"]  # the loop went on
            await wait_released(mesh)
    run(go())
