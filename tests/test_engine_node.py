"""The runtime drives EngineNode submodules through their EngineDriver: calls of many
requests share engine steps, a failed step fails its requests alone, and release frees
what the engine holds."""

import asyncio
import time

import grpc
import pytest
import torch

from mstar import wire
from mstar.config import parse_config
from mstar.models.base import EngineNode, InvalidArgument, Model, NodeCall, Output, RequestState, WalkSeed
from mstar.models.graph import EMIT_TO_CLIENT, INPUT, EngineType, GraphEdge, GraphNode, Loop, Modality, Walk
from mstar.models.registry import register
from mstar.services.engines.kv_engine import StepFailed
from mstar.services.engines.seq_engine import SeqOutput
from mstar.services.engines.sequence import SeqStatus
from mstar.v1 import conductor_pb2 as cpb

from helpers import collect, run, wait_released
from inprocess import inprocess_mesh

ENGINES: list["CountingEngine"] = []


class CountingEngine:
    """A fake sequence engine (the surface of seq_engine.LocalSeqEngine): a sequence's first
    output needs 3 steps (like a chunked prefill), later ones 1; every step advances every
    sequence (continuous batching), whether or not its loop asked for the token yet."""

    #: sequences the first step waits for (a test that must see a shared step sets it: with 1, requests
    #: arriving a few ms apart on a loaded machine may each run alone)
    first_batch = 1

    def __init__(self):
        self.seqs: dict[str, list] = {}  # request -> [seed, outputs so far, steps to next output, n]
        self.batch_sizes: list[int] = []
        self.explode: dict[str, int] = {}
        ENGINES.append(self)

    def submit(self, rid, work):
        assert rid not in self.seqs
        seed, n, explode_at = work
        self.seqs[rid] = [seed, 0, 3, n]
        if explode_at is not None:
            self.explode[rid] = explode_at

    @property
    def has_work(self):
        return len(self.seqs) >= (self.first_batch if not self.batch_sizes else 1)

    def step(self):
        self.batch_sizes.append(len(self.seqs))
        outs = []
        for rid, s in list(self.seqs.items()):
            s[2] -= 1
            if s[2]:
                continue
            if self.explode.get(rid) == s[1]:
                del self.seqs[rid]
                err = StepFailed([rid])
                err.__cause__ = RuntimeError("engine exploded")
                raise err
            tok = s[1] * 10 + s[0]
            s[1], s[2] = s[1] + 1, 1
            done = s[1] >= s[3]
            if done:
                del self.seqs[rid]
            outs.append(SeqOutput(rid, tok, SeqStatus.FINISHED_LENGTH if done else SeqStatus.RUNNING))
        return outs

    def release(self, rid):
        self.seqs.pop(rid, None)

    def close(self):
        pass

    def exit_reason(self):
        return None


class CountingNode(EngineNode):
    blocking = False

    def __init__(self):
        self.engine = CountingEngine()

    def prepare(self, call):
        if call.iteration == 0:
            return (int(call.inputs["seed"]), call.kwargs["n"], call.kwargs.get("explode_at"))
        return None

    def outputs(self, call, out):
        return {"tok": torch.tensor([-1 if out is None else out.token_id])}

    def check_stop(self, call, outputs):
        return call.iteration + 1 >= call.kwargs["n"]


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
        return CountingNode()


register("counter", f"{__name__}:Counter")
CFG = parse_config({"model": "counter", "node_groups": [{"name": "lm", "node_names": ["lm"]}]})


def req(seed, **kw):
    import json
    return cpb.GenerateRequest(model="counter", text=str(seed), model_kwargs_json=json.dumps(kw))


@pytest.mark.parametrize("blocking", [False, True], ids=["on-the-loop", "engine-thread"])
def test_engine_node_batches_across_requests_and_releases(blocking, monkeypatch):
    monkeypatch.setattr(CountingNode, "blocking", blocking)  # True: it steps on the node group's engine thread
    monkeypatch.setattr(CountingEngine, "first_batch", 2)  # the six requests below: at least two share a step
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
            driver = mesh.runtime("lm").drivers["lm"]
            for _ in range(100):  # engine releases happen between engine steps
                if not engine.seqs and not driver._held:
                    break
                await asyncio.sleep(0.01)
            assert engine.seqs == {} and driver._waiting == {} and driver._held == set() and driver._early == {}
    run(go())


def test_engine_node_rejects_forward():
    with pytest.raises(TypeError, match="prepare / outputs"):
        CountingNode().forward([])


class HalfEngine:
    """A fake engine that steps but was never given a way to stop (no close, no exit_reason)."""

    has_work = False

    def submit(self, rid, work):
        pass

    def release(self, rid):
        pass

    def step(self):
        return []


def test_an_engine_missing_part_of_the_contract_is_refused_when_its_node_is_made():
    """An engine node whose engine lacks members of the engine contract fails at construction with
    a TypeError naming them (not at the service's first close, or first call); a node that never
    set an engine is refused when its driver is made, before any call; an Engine subclass missing
    a method cannot be instantiated at all."""
    from mstar.models.engine import Engine
    from mstar.services.node_group.engine_driver import EngineDriver

    class HalfNode(CountingNode):
        def __init__(self):
            self.engine = HalfEngine()

    with pytest.raises(TypeError, match=r"engine node HalfNode: its engine HalfEngine lacks close, exit_reason of "
                                        r"the engine contract"):
        HalfNode()

    class Stepless(CountingEngine):  # a step that is not callable counts as missing
        step = None

    class SteplessNode(CountingNode):
        def __init__(self):
            self.engine = Stepless()

    with pytest.raises(TypeError, match="lacks step of"):
        SteplessNode()

    class NoEngineNode(CountingNode):
        def __init__(self):
            pass

    with pytest.raises(TypeError, match="engine node 'lm' has no engine"):
        EngineDriver("lm", NoEngineNode(), None, lambda: None)

    class Unfinished(Engine):
        has_work = False

        def submit(self, request_id, work):
            pass

        def release(self, request_id):
            pass

        def step(self):
            return []

        def close(self):
            pass

    with pytest.raises(TypeError, match="abstract method 'exit_reason'|abstract method exit_reason"):
        Unfinished()
    assert EngineDriver("lm", CountingNode(), None, lambda: None).engine is ENGINES[-1]  # a whole engine is taken


class FedEngine:
    """A fake engine fed a row an iteration (as the Talker's): a step answers exactly the work
    handed to it since the last one."""

    def __init__(self):
        self.pending: dict = {}
        self.batches: list[list[str]] = []
        self.times: list[float] = []

    def submit(self, rid, work):
        self.pending[rid] = work

    def release(self, rid):
        self.pending.pop(rid, None)

    @property
    def has_work(self):
        return bool(self.pending)

    def step(self):
        batch, self.pending = self.pending, {}
        self.batches.append(sorted(batch))
        self.times.append(time.perf_counter())
        return [SeqOutput(rid, 1, SeqStatus.RUNNING) for rid in batch]

    def close(self):
        pass

    def exit_reason(self):
        return None


class FedNode(EngineNode):
    blocking = False  # steps on the event loop: the test sees each launch

    def __init__(self, gather_s):
        self.engine, self.gather_s = FedEngine(), gather_s

    def prepare(self, call):
        return ("feed", call.iteration)

    def outputs(self, call, out):
        return {"x": torch.tensor([call.iteration])}


def fed_driver(node):
    """An ``EngineDriver`` of ``node`` on the running loop: ``call(rid, iteration)`` submits a call,
    ``await settle(seconds)`` runs the runtime's loop (poll on every wake) that long -> completions."""
    from mstar.services.node_group.engine_driver import EngineDriver

    loop = asyncio.get_running_loop()
    wakes = asyncio.Event()
    driver = EngineDriver("n", node, None, wakes.set)

    def call(rid, it):
        return driver.submit(NodeCall(rid, "w", it, {}, {}, {}), rid)

    async def settle(seconds):
        end = loop.time() + seconds
        done = []
        while loop.time() < end:
            done += driver.poll(loop) or []
            wakes.clear()
            try:
                await asyncio.wait_for(wakes.wait(), max(0.001, end - loop.time()))
            except TimeoutError:
                pass
        return done

    return call, settle


@pytest.mark.parametrize("gather_s", [0.0, 0.05])
def test_a_fed_engine_gathers_the_next_calls_of_its_running_sequences(gather_s):
    """Two running sequences whose calls come a few ms apart (the second's output is still being
    routed): with ``gather_s`` the step waits for the second call and serves both (one step of
    two rows, not two of one); without, it steps at once. A sequence whose call never comes holds
    a step at most ``gather_s``."""
    async def go():
        node = FedNode(gather_s)
        call, settle = fed_driver(node)
        call("a", 0), call("b", 0)
        await settle(0.01)  # both start together
        call("a", 1)
        await settle(0.01)  # b's next call comes 10 ms later
        call("b", 1)
        await settle(0.1)
        t0 = time.perf_counter()
        call("a", 2)  # b's next call never comes: a steps once gather_s has passed
        done = await settle(0.2)
        return node.engine, done, t0
    engine, done, t0 = run(go(), timeout=10)
    if gather_s:
        assert engine.batches == [["a", "b"], ["a", "b"], ["a"]]
    else:
        assert engine.batches == [["a", "b"], ["a"], ["b"], ["a"]]
    assert gather_s <= engine.times[-1] - t0 < gather_s + 0.1
    assert [c.request_id for c, _, _ in done][-1] == "a"


def test_a_gather_with_less_than_a_millisecond_left_under_uvloop():
    """uvloop's ``call_later`` hands back a plain Handle, which has no ``when()``, for a delay that
    rounds to 0 ms. The gather wait checked the pending wake-up through it and raised
    AttributeError on its next check (test_omni_tp_serving's speech group failed so, 1 run in 3). With
    0.3 ms to wait for a call that never comes, the step runs once the time is up."""
    uvloop = pytest.importorskip("uvloop", reason="the services' event loop (the case is uvloop's)")

    async def go():
        node = FedNode(0.0003)
        call, settle = fed_driver(node)
        call("a", 0), call("b", 0)
        await settle(0.01)
        call("a", 1)  # b's next call never comes
        await settle(0.02)
        return node.engine.batches

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        batches = runner.run(asyncio.wait_for(go(), 10))
    assert batches == [["a", "b"], ["a"]]
