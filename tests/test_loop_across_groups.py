"""A loop split over two node groups: the owner decides the end, the other group
learns it by LOOP_END; carried values, exits, persisted values and emits at the loop's end
cross groups."""

import grpc
import pytest
import torch

from mstar import wire
from mstar.config import parse_config
from mstar.models.base import Model, Output, RequestState, WalkSeed
from mstar.models.graph import (
    EMIT_TO_CLIENT,
    EMIT_TO_CONDUCTOR,
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
from mstar.services.transport import Protocol
from mstar.v1 import conductor_pb2 as cpb

from helpers import Fn, TensorModel, collect, run, wait_released
from inprocess import inprocess_mesh


def a_fn(c):
    ball = c.inputs.get("ball")
    x = torch.tensor([1]) if ball is None else ball - 1000 + 1
    return {"ball": x, "tick": x}


NODES = {
    "src": Fn(lambda c: {"start": c.inputs["n"]}),
    "a": None,
    "b": Fn(lambda c: {"ball": c.inputs["ball"] + 1000, "trail": c.inputs["ball"], "tock": c.inputs["ball"],
                       "rounds": torch.tensor([c.iteration + 1])}),
    "c": Fn(lambda c: {"total": c.inputs["trail"].sum().reshape(1)}),
}


class PingPong(Model):
    name = "pingpong"
    nodes = tuple(GraphNode(n) for n in NODES)
    last_tick_only = False

    def build_walks(self):
        return [
            Walk("prep", "src", [GraphEdge(INPUT, "src", "n"), GraphEdge("src", "a", "start", persist=True)]),
            Walk("play", Sequential(Loop(Sequential("a", "b"), 50, stop_node="a", accumulate=frozenset({"trail"})), "c"), [
                GraphEdge(INPUT, "a", "start"), GraphEdge("a", "b", "ball"), GraphEdge("b", "a", "ball"),
                GraphEdge("b", "c", "trail"),
                GraphEdge("b", EMIT_TO_CLIENT, "tock", modality=Modality.LATENT),
                GraphEdge("c", EMIT_TO_CLIENT, "total", modality=Modality.LATENT),
                # once, at the loop's end: from the owner group (a) and from the other one (b)
                GraphEdge("a", EMIT_TO_CLIENT, "tick", modality=Modality.LATENT, at_loop_end=True)
                if self.last_tick_only else GraphEdge("a", EMIT_TO_CLIENT, "tick", modality=Modality.LATENT),
                GraphEdge("b", EMIT_TO_CONDUCTOR, "rounds", at_loop_end=True)]),
        ]

    def process_prompt(self, prompt):
        return RequestState(prompt, data={"n": int(prompt.text)})

    def next_walk(self, state, finished):
        return {None: WalkSeed("prep", {"n": torch.tensor([state.data["n"]])}), "prep": WalkSeed("play")}.get(finished)

    def postprocess(self, state, emit):
        if emit.name == "rounds":  # for the state machine only: the request's finish reason
            state.finish_reason = f"rounds={int(emit.tensor)}"
            return []
        return [Output(emit.name, Modality.LATENT, tensor=emit.tensor)]

    def create_submodule(self, ctx):
        if ctx.node == "a":
            return Fn(a_fn, stop=lambda c, o: int(o["ball"]) >= int(c.inputs["start"]))
        return NODES[ctx.node]


register("pingpong", f"{__name__}:PingPong")


@pytest.mark.parametrize("protocol", [Protocol.TCP, Protocol.SHM])
def test_loop_split_over_two_groups(protocol):
    cfg = parse_config({"model": "pingpong", "node_groups": [
        {"name": "left", "node_names": ["src", "a", "c"]}, {"name": "right", "node_names": ["b"]}]})

    async def go():
        async with inprocess_mesh(cfg, protocol) as mesh:
            for n in (1, 7):
                out, final = await collect(mesh.stub, cpb.GenerateRequest(model="pingpong", text=str(n)))
                vals = {k: [wire.from_proto(c.tensor).item() for c in v] for k, v in out.items()}
                assert vals["tick"] == list(range(1, n + 1))
                assert vals["tock"] == list(range(1, n + 1))  # the far side ran exactly the owner's iterations
                assert vals["total"] == [n * (n + 1) // 2]  # accumulated exit crossed back
                assert final.usage.walks == 2
                assert final.finish_reason == f"rounds={n}"  # b's value at the loop's end, postprocessed
                assert "rounds" not in out  # EMIT_TO_CONDUCTOR never reaches the client
            await wait_released(mesh)
    run(go())


class LastTick(PingPong):
    name = "pingpong_last"
    last_tick_only = True


register("pingpong_last", f"{__name__}:LastTick")


def test_emits_at_the_loop_end_fire_once_from_either_group():
    cfg = parse_config({"model": "pingpong_last", "node_groups": [
        {"name": "left", "node_names": ["src", "a", "c"]}, {"name": "right", "node_names": ["b"]}]})
    assert LastTick().outputs == {"tick": Modality.LATENT, "tock": Modality.LATENT, "total": Modality.LATENT}

    async def go():
        async with inprocess_mesh(cfg, Protocol.TCP) as mesh:
            for n in (1, 7):
                out, final = await collect(mesh.stub, cpb.GenerateRequest(model="pingpong_last", text=str(n)))
                vals = {k: [wire.from_proto(c.tensor).item() for c in v] for k, v in out.items()}
                assert vals["tick"] == [n]  # the last iteration's value, once
                assert vals["tock"] == list(range(1, n + 1))  # every iteration
                assert final.finish_reason == f"rounds={n}"
            await wait_released(mesh)
    run(go())


class SkipsPrep(PingPong):
    name = "pingpong_skip"

    def next_walk(self, state, finished):
        return WalkSeed("play") if finished is None else None  # "start" was never given nor persisted


register("pingpong_skip", f"{__name__}:SkipsPrep")


def test_a_walk_input_nobody_provided_fails_the_request_naming_it():
    cfg = parse_config({"model": "pingpong_skip", "node_groups": [{"name": "all", "node_names": ["src", "a", "b", "c"]}]})

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(mesh.stub, cpb.GenerateRequest(model="pingpong_skip", text="3"))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "input 'start' for node 'a'" in e.value.details()
            await wait_released(mesh)
    run(go())


class FanOut(TensorModel):
    """One loop output fanned out to two nodes after the loop and, by the same name, emitted at
    the loop's end; node ``a`` raises in check_stop when asked to (a model bug)."""

    name = "fanout"
    nodes = (GraphNode("a"), GraphNode("c"), GraphNode("d"))

    def build_walks(self):
        return [Walk("w", Sequential(Loop("a", 3, stop_node="a", accumulate=frozenset({"x"})), Parallel("c", "d")), [
            GraphEdge(INPUT, "a", "n"), GraphEdge("a", "c", "x"), GraphEdge("a", "d", "x"),
            GraphEdge("a", EMIT_TO_CLIENT, "x", modality=Modality.LATENT, at_loop_end=True),
            GraphEdge("c", EMIT_TO_CLIENT, "cs", modality=Modality.LATENT),
            GraphEdge("d", EMIT_TO_CLIENT, "ds", modality=Modality.LATENT)])]

    def next_walk(self, state, finished):
        return WalkSeed("w", {"n": torch.tensor([int(state.prompt.text)])}) if finished is None else None

    def create_submodule(self, ctx):
        def stop(call, out):
            if int(call.inputs["n"]) < 0:
                raise ValueError("negative n")
            return False

        return {"a": Fn(lambda c: {"x": torch.tensor([c.iteration + 1])}, stop=stop),
                "c": Fn(lambda c: {"cs": c.inputs["x"].sum().reshape(1)}),
                "d": Fn(lambda c: {"ds": (c.inputs["x"] * 10).sum().reshape(1)})}[ctx.node]


register("fanout", f"{__name__}:FanOut")


def test_a_loop_output_fans_out_and_a_model_bug_fails_only_its_request():
    cfg = parse_config({"model": "fanout", "node_groups": [{"name": "g", "node_names": ["a", "c", "d"]}]})

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            out, _ = await collect(mesh.stub, cpb.GenerateRequest(model="fanout", text="1"))
            vals = {k: [wire.from_proto(c.tensor).tolist() for c in v] for k, v in out.items()}
            assert vals == {"x": [[1, 2, 3]], "cs": [[6]], "ds": [[60]]}  # each consumer gets the exit once
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(mesh.stub, cpb.GenerateRequest(model="fanout", text="-1"), timeout=10)
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "node group 'g'" in e.value.details() and "ValueError: negative n" in e.value.details()
            out, _ = await collect(mesh.stub, cpb.GenerateRequest(model="fanout", text="2"))  # the group still serves
            assert [wire.from_proto(c.tensor).tolist() for c in out["cs"]] == [[6]]
            await wait_released(mesh)
    run(go())


def test_a_frame_the_group_cannot_handle_fails_its_request_not_the_stream():
    from mstar.v1 import node_group_pb2 as pb

    cfg = parse_config({"model": "fanout", "node_groups": [{"name": "g", "node_names": ["a", "c", "d"]}]})

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            runtime = mesh.runtime("g")
            # LOOP_END for a node outside any loop: no peer sends it; the handler asserts on it
            bad = pb.Frame(kind=pb.FRAME_KIND_LOOP_END, request_id="bad", walk="w", walk_seq=1, node="c", iteration=0)
            runtime.on_batch(pb.FrameBatch(sender="test", frames=[bad]), [[]])  # no exception escapes
            assert "bad" not in runtime.requests and "bad" in runtime.released
            out, _ = await collect(mesh.stub, cpb.GenerateRequest(model="fanout", text="1"))
            assert [wire.from_proto(c.tensor).tolist() for c in out["ds"]] == [[60]]
            await wait_released(mesh)
    run(go())
