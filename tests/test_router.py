"""The node group's router and schedule on their own: no links, no processes, no event loop.
Frames in and node outputs become state changes plus effects (Send / Advance / Handed) in order."""

import grpc
import pytest
import torch

from mstar.config import Placement
from mstar.models.base import NodeCall, NodeContext
from mstar.models.registry import create_model
from mstar.services.node_group.requests import CONDUCTOR, Advance, Handed, RequestCtx, RequestFailed, Send
from mstar.services.node_group.router import K, Router
from mstar.services.node_group.schedule import Schedule

TOKENS = torch.tensor(list(b"Hi"))


def setup(toy_config, group, name="default"):
    config = toy_config(name)
    model = create_model(config.model, config.model_kwargs)
    router = Router(group, model, Placement(config, model))
    subs = {n: model.create_submodule(NodeContext(n, "cpu", None, {})) for n in config.group(group).node_names}
    return model, router, Schedule(router, subs)


def fire(model, router, schedule, req, out, stop=None, handed=None):
    """Run every queued call through the toy's own nodes, routing their outputs; as the runtime
    does, ask the node's ``check_stop`` (or ``stop``) only where ``Router.fired`` says the call
    decides its loop. ``handed`` collects the local hand-overs (``Handed`` effects)."""
    fired = []
    while (nxt := schedule.next_batch(set())) is not None:
        (walk, node), batch = nxt
        sub = model.create_submodule(NodeContext(node, "cpu", None, {}))
        for p in batch:
            inst = req.instances[p.key]
            call = NodeCall(p.request_id, walk, p.iteration, p.inputs, req.kwargs, req.node_state.setdefault(node, {}),
                            inst.chunk)
            outputs = sub.forward([call])[0]
            decides = router.fired(inst, node, call, outputs)
            router.after_fire(req, inst, node, call, outputs,
                              (stop or sub.check_stop)(call, outputs) if decides else None, out)
            out.append(Advance(inst))
            fired.append((node, p.iteration))
        drain(schedule, req, out, handed)
    return fired


def drain(schedule, req, out, handed=None):
    """What the runtime's _apply does, without links: advance instances, keep the sends (and
    the local hand-overs in ``handed``)."""
    sends = []
    for e in out:
        if type(e) is Send:
            sends.append(e)
        elif type(e) is Handed:
            if handed is not None:
                handed.append(e)
        else:
            schedule.advance(req, e.inst, out)
    out[:] = sends


def test_encode_fans_out_locally_and_sends_the_persisted_state(toy_config):
    model, router, schedule = setup(toy_config, "encoder")
    req, out = RequestCtx("r", kwargs={"max_tokens": 8}), []
    inst = router.instance(req, ("encode", 0, -1))
    router.start_walk(req, inst, 0, {"tokens": TOKENS}, out)
    assert inst.started and [type(e) for e in out] == [Advance]
    drain(schedule, req, out)
    fired = fire(model, router, schedule, req, out)
    assert sorted(fired) == [("combine", -1), ("keep", -1), ("rot", -1)]  # the walk's nodes, all here
    data, done = out
    assert data.target == "decoder" and data.frame.kind == K.FRAME_KIND_DATA and data.frame.edge == "text_state"
    assert data.tensors[0][1].tolist() == list(b"Uv")  # ROT13, handed over as the tensor itself
    assert done.target == CONDUCTOR and done.frame.kind == K.FRAME_KIND_FRAGMENT_DONE
    assert dict(done.frame.persisted_sent) == {"decoder": 1} and req.persist_sent == {}
    assert req.instances == {}  # the finished fragment is dropped


def test_a_walk_waits_for_persisted_values_that_trail_its_start(toy_config):
    model, router, schedule = setup(toy_config, "decoder")
    req, out = RequestCtx("r", kwargs={"max_tokens": 8}), []
    inst = router.instance(req, ("generate", 1, -1))
    router.start_walk(req, inst, 1, {}, out)
    assert not inst.started and out == [] and len(req.parked) == 1
    enc = router.instance(req, ("encode", 0, -1))
    router.accept(req, enc, "decoder", "text_state", -1, torch.tensor(list(b"Uv")), False, out)
    router.unpark(req, out)
    assert inst.started and req.parked == [] and req.persisted[("decoder", "text_state")].tolist() == list(b"Uv")
    assert any(type(e) is Advance and e.inst is inst for e in out)


def test_generate_emits_streams_remotely_and_ends_its_loop(toy_config):
    model, router, schedule = setup(toy_config, "decoder")
    req, out = RequestCtx("r", kwargs={"max_tokens": 8}), []
    req.persisted[("decoder", "text_state")] = torch.tensor(list(b"Uvyyb"))
    inst = router.instance(req, ("generate", 0, -1))
    router.start_walk(req, inst, 0, {}, out)
    drain(schedule, req, out)
    fired = fire(model, router, schedule, req, out)
    assert fired == [("decoder", i) for i in range(5)] + [("tally", -1)]
    emits = [s for s in out if s.frame.kind == K.FRAME_KIND_EMIT]
    assert [s.frame.edge for s in emits] == ["text"] * 5 + ["summary"]
    assert [int(s.tensors[0][1]) for s in emits[:5]] == list(b"Uvyyb")
    streams = [s for s in out if s.frame.kind == K.FRAME_KIND_DATA]
    assert {s.target for s in streams} == {"audio"}  # every chunk walk runs in the audio group
    assert all(s.frame.done for s in streams[-3:])  # each stream ends once, after the loop's last iteration
    assert sum(s.tensors[0][1].numel() for s in streams if s.frame.edge == "token" and s.frame.node == "meter") == 5
    assert out[-1].frame.kind == K.FRAME_KIND_FRAGMENT_DONE


def test_bad_frames_and_outputs_fail_the_request_with_a_status(toy_config):
    model, router, _ = setup(toy_config, "decoder")
    req = RequestCtx("r", kwargs={"max_tokens": 8})
    with pytest.raises(RequestFailed) as e:
        router.instance(req, ("nope", 0, -1))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "unknown walk 'nope'" in e.value.message
    inst = router.instance(req, ("generate", 0, -1))
    call = NodeCall("r", "generate", 0, {"text_state": torch.tensor(list(b"Uv"))}, req.kwargs, {})
    with pytest.raises(RequestFailed) as e:
        router.fired(inst, "decoder", call, [{"text": torch.tensor([1])}])
    assert e.value.code == grpc.StatusCode.INTERNAL and "returned list for a call" in e.value.message
    with pytest.raises(RequestFailed) as e:
        router.after_fire(req, inst, "decoder", call, {"text": torch.tensor([1])}, False, [])
    assert e.value.code == grpc.StatusCode.INTERNAL and "returned no output" in e.value.message
    with pytest.raises(RequestFailed, match="outside a loop"):
        router.loop_end(req, inst, "tally", 0, [])
    req2 = RequestCtx("s", kwargs={})
    with pytest.raises(RequestFailed) as e:
        router.start_walk(req2, router.instance(req2, ("generate", 0, -1)), 0, {}, [])
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "text_state" in e.value.message


def test_the_router_takes_the_stop_as_a_value_and_hands_over_locally_as_effects(toy_config):
    """The router calls no model code and records no metrics: the loop stops where the caller's
    answer says (here after iteration 1, though the toy's own check_stop would run all 5 bytes),
    ``fired`` asks for that answer only for the loop's stop node, and each value the decoder
    hands over here (to itself, to its colocated tally) comes back as a ``Handed`` effect with its bytes."""
    model, router, schedule = setup(toy_config, "decoder")
    req, out = RequestCtx("r", kwargs={"max_tokens": 8}), []
    req.persisted[("decoder", "text_state")] = torch.tensor(list(b"Uvyyb"))
    inst = router.instance(req, ("generate", 0, -1))
    router.start_walk(req, inst, 0, {}, out)
    drain(schedule, req, out)
    asked, handed = [], []

    def stop(call, outputs):
        asked.append(call.iteration)
        return call.iteration == 1

    fired = fire(model, router, schedule, req, out, stop, handed)
    assert fired == [("decoder", 0), ("decoder", 1), ("tally", -1)]
    assert asked == [0, 1]  # the decoder's calls only: the tally ends no loop
    emits = [s for s in out if s.frame.kind == K.FRAME_KIND_EMIT and s.frame.edge == "text"]
    assert [int(s.tensors[0][1]) for s in emits] == list(b"Uv")
    # the byte carried into iteration 1 (none into 2: the loop ended), then the loop's two
    # generated bytes for the tally at its end (int64 each)
    assert handed == [Handed("prev", 8), Handed("generated", 16)]
