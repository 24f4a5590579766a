"""Where values go: the walk bookkeeping of one node group, with no I/O.

Frames in (walk starts, edge values, loop ends) and node outputs become state changes of
the request's walk instances plus effects appended to ``out``: ``Send`` (a frame for a peer
group or the conductor), ``Advance`` (an instance that may have nodes ready) and ``Handed`` (a
value handed over here: the edge's local traffic). The runtime applies them in order.
Colocated destinations get the tensor object itself. The router calls no model code and
records no metrics: a loop's stop decision comes in as a value (``fired`` says when the caller
must ask the model's ``check_stop``), and what it would count leaves as effects.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import grpc
import torch

from mstar.config import Placement
from mstar.models.base import Model, NodeCall
from mstar.models.chunker import Chunker
from mstar.models.graph import INPUT, StreamingGraphEdge
from mstar.models.plan import EdgeKind
from mstar.services.node_group.fragment import TAKES_ALL, InstanceKey, WalkInstance
from mstar.services.node_group.requests import (
    CONDUCTOR,
    Advance,
    Effect,
    Handed,
    RequestCtx,
    RequestFailed,
    Send,
)
from mstar.v1 import node_group_pb2 as pb

K = SimpleNamespace(**dict(pb.FrameKind.items()))  # plain ints: the enum wrapper's attribute lookup costs ~3 us
Out = list[Effect]


class Router:
    def __init__(self, group: str, model: Model, placement: Placement):
        self.group, self.model, self.placement = group, model, placement
        host = placement.host
        self.local: dict[str, tuple[str, ...]] = {}
        self.owner_loops: dict[str, frozenset[str]] = {}
        self.loop_peers: dict[tuple[str, str], list[str]] = {}
        self.persisted: dict[str, set[tuple[str, str]]] = {}
        self.inputs: dict[str, list[tuple[str, str]]] = {}  # walk -> (node, input) read here
        self.streams_in: dict[str, dict[tuple[str, str], StreamingGraphEdge]] = {}  # into chunk walks hosted here
        self.loop_streams_in: dict[str, dict[tuple[str, str], StreamingGraphEdge]] = {}  # into running loops here
        for walk, plan in model.plans.items():
            self.local[walk] = tuple(n for n in plan.nodes if host(walk, n) == group)
            self.owner_loops[walk] = frozenset(lp for lp in plan.loops if placement.loop_owner(walk, lp) == group)
            for lp in plan.loops.values():
                self.loop_peers[(walk, lp.name)] = sorted({host(walk, n) for n in lp.nodes} - {group})
            self.persisted[walk] = {(e.dst, e.name) for e in plan.walk.edges if e.persist}
            self.inputs[walk] = [(e.dst, e.name) for e in plan.walk.edges if e.src == INPUT and e.dst in self.local[walk]]
            self.streams_in[walk] = {(e.dst, e.name): e for e in plan.streams  # into chunk walks: each has a topology
                                     if host(e.topology.dst_walk, e.dst) == group}  # type: ignore[union-attr]
            self.loop_streams_in[walk] = {(e.dst, e.name): e for e in plan.loop_streams if host(walk, e.dst) == group}
        self.persist_targets = {(e.dst, e.name): placement.persist_targets(e.dst, e.name)
                                for plan in model.plans.values() for e in plan.walk.edges if e.persist}

    # -- instances ---------------------------------------------------------------------------
    def instance(self, req: RequestCtx, key: InstanceKey) -> WalkInstance:
        """The request's instance ``key``, created on its first frame."""
        inst = req.instances.get(key)
        if inst is None:
            walk = key[0]
            if walk not in self.model.plans:
                raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"node group '{self.group}': unknown walk '{walk}'")
            streams = len(self.streams_in[walk]) + len(self.loop_streams_in[walk]) if key[2] < 0 else 0
            inst = req.instances[key] = WalkInstance(key, self.model.plans[walk], self.local[walk], self.owner_loops[walk],
                                                     open_streams=streams)
        return inst

    def start_walk(self, req: RequestCtx, inst: WalkInstance, expected: int, given: dict[str, torch.Tensor],
                   out: Out) -> None:
        """START_WALK: the walk starts once ``expected`` persisted values have arrived."""
        req.parked.append((inst, expected, given))
        self.unpark(req, out)

    def unpark(self, req: RequestCtx, out: Out) -> None:
        """Start walks whose persisted inputs have all arrived (they may trail START_WALK)."""
        if not req.parked:
            return
        waiting = []
        for inst, expected, given in req.parked:
            if req.persist_received < expected:
                waiting.append((inst, expected, given))
                continue
            self._start(req, inst, given)
            out.extend(Advance(other) for other in list(req.instances.values()))  # chunk walks spawned before the start
        req.parked = waiting

    def _start(self, req: RequestCtx, inst: WalkInstance, given: dict[str, torch.Tensor]) -> None:
        for node, name in self.inputs[inst.walk]:
            value = given.get(name)
            if value is None:
                value = req.persisted.get((node, name))
            if value is None:
                raise RequestFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"node group '{self.group}': walk '{inst.walk}' input '{name}' for node '{node}' "
                                    f"was neither given when the walk started nor persisted by an earlier walk")
            inst.put(node, name, -1, value)
        inst.started = True

    def _spawn(self, req: RequestCtx, parent: WalkInstance, dst_walk: str, edge: str, chunks, out: Out) -> None:
        """A chunk walk per local stream chunk, started with the chunk as its input."""
        for info, tensor in chunks:
            child = self.instance(req, (dst_walk, parent.key[1], info.index))
            child.chunk, child.parent = info, parent.key
            parent.children += 1
            self._start(req, child, {edge: tensor})
            out.append(Advance(child))

    # -- in ----------------------------------------------------------------------------------
    def accept(self, req: RequestCtx, inst: WalkInstance, node: str, edge: str, iteration: int,
               value: torch.Tensor | None, done: bool, out: Out) -> None:
        """A value on edge ``edge`` into ``node`` (``done``: a stream's last item)."""
        walk = inst.walk
        if value is not None and (node, edge) in self.persisted[walk]:
            req.persisted[(node, edge)] = value
            req.persist_received += 1
        into_loop = self.loop_streams_in[walk].get((node, edge))
        if into_loop is not None:
            chunks = self._cut(inst, into_loop, value, done)
            if not inst.node_finished(node):  # a consumer whose loop ended takes no more
                inst.inflow.setdefault(node, deque()).extend(chunks)
            return
        stream = self.streams_in[walk].get((node, edge))
        if stream is not None:
            self._spawn(req, inst, stream.topology.dst_walk,  # type: ignore[union-attr]  # streams_in: with a topology
                        edge, self._cut(inst, stream, value, done), out)
        elif node in inst.plan.nodes and value is not None and self.placement.host(walk, node) == self.group:
            inst.put(node, edge, iteration, value)

    @staticmethod
    def _cut(inst: WalkInstance, e: StreamingGraphEdge, value: torch.Tensor | None, done: bool):
        """Chunks a stream's new rows (and its end) complete, under the stream's policy."""
        chunker = inst.chunkers.get((e.dst, e.name))
        if chunker is None:
            chunker = inst.chunkers[(e.dst, e.name)] = Chunker(e.policy)
        chunks = chunker.push(value) if value is not None else []
        if done:
            chunks += chunker.finish()
            inst.open_streams -= 1
            inst.stream_ended.add(e.dst)
        return chunks

    def stream_taken(self, req: RequestCtx, inst: WalkInstance, node: str, edge: str, taken: int, done: bool) -> None:
        """STREAM_TAKEN from a consumer's group: the producer may run up to max_ahead past ``taken``."""
        key = (node, edge)
        inst.credit[key] = TAKES_ALL if done else max(inst.credit.get(key, 0), taken)

    def loop_end(self, req: RequestCtx, inst: WalkInstance, node: str, iteration: int, out: Out) -> None:
        """LOOP_END from the loop's owner: the loop holding ``node`` ended after ``iteration``."""
        lp = inst.plan.nodes[node].loop
        if lp is None:
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"node group '{self.group}': LOOP_END for node '{node}' "
                                f"outside a loop in walk '{inst.walk}'")
        inst.end_loop(lp.name, iteration)
        for n in inst.local:
            self.flush_loop_outputs(req, inst, n, out)

    # -- out ---------------------------------------------------------------------------------
    def _frame(self, inst: WalkInstance, req: RequestCtx, kind, **kw) -> pb.Frame:
        return pb.Frame(kind=kind, request_id=req.request_id, walk=inst.walk, walk_seq=inst.key[1],
                        chunk_index=inst.key[2], parent_walk_seq=-1, **kw)

    def _deliver(self, req: RequestCtx, inst: WalkInstance, dst: str, name: str, iteration: int, value,
                 targets: list[str], out: Out, done: bool = False) -> None:
        persisted = value is not None and (dst, name) in self.persisted[inst.walk]
        for target in targets:
            if persisted:
                req.persist_sent[target] = req.persist_sent.get(target, 0) + 1
            if target == self.group:
                if value is not None:
                    out.append(Handed(name, value.nbytes))
                self.accept(req, inst, dst, name, iteration, value, done, out)
            else:
                frame = self._frame(inst, req, K.FRAME_KIND_DATA, node=dst, edge=name, iteration=iteration, done=done)
                out.append(Send(target, frame, [(name, value)] if value is not None else []))

    def fired(self, inst: WalkInstance, node: str, call: NodeCall, outputs: dict) -> bool:
        """``node`` fired for ``call`` and returned ``outputs``: the call is done. True when this
        call decides whether its loop stops here: the caller asks the model (``check_stop``) and
        hands the answer to ``after_fire``."""
        if not isinstance(outputs, dict):
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"node group '{self.group}': node '{node}' returned "
                                f"{type(outputs).__name__} for a call; a call's outputs are a dict of name -> torch.Tensor")
        inst.busy.discard(node)
        inst.fired[node] = inst.fired.get(node, 0) + 1
        inst.consume(node, call.iteration)
        lp = inst.plan.nodes[node].loop
        return lp is not None and lp.stop_node == node and lp.name in inst.owner_loops

    def after_fire(self, req: RequestCtx, inst: WalkInstance, node: str, call: NodeCall, outputs: dict,
                   stop: bool | None, out: Out) -> None:
        """After ``fired``: decide the loop (``stop``: the model's answer where ``fired`` said this
        call decides it, None where it does not), route every value."""
        it = call.iteration
        node_plan = inst.plan.nodes[node]
        lp = node_plan.loop
        if stop is not None:
            assert lp is not None  # fired() said this call decides its loop
            if stop or it + 1 >= lp.max_iters:
                inst.end_loop(lp.name, it)
                for peer in self.loop_peers[(inst.walk, lp.name)]:
                    out.append(Send(peer, self._frame(inst, req, K.FRAME_KIND_LOOP_END, node=node, iteration=it), []))
            else:
                inst.decided[lp.name] = it + 1
        host = self.placement.host
        for pe in node_plan.out_edges:
            e = pe.edge
            value = outputs.get(e.name)
            if value is None:
                raise RequestFailed(grpc.StatusCode.INTERNAL, f"node group '{self.group}': node '{node}' returned no "
                                    f"output '{e.name}' (edge to '{e.dst}'); it returned {sorted(outputs)}")
            if not isinstance(value, torch.Tensor):
                raise RequestFailed(grpc.StatusCode.INTERNAL, f"node group '{self.group}': node '{node}' returned "
                                    f"output '{e.name}' as {type(value).__name__}; outputs must be torch.Tensor")
            kind = pe.kind
            if kind is EdgeKind.EMIT:
                frame = self._frame(inst, req, K.FRAME_KIND_EMIT, node=node, edge=e.name, iteration=it)
                out.append(Send(CONDUCTOR, frame, [(e.name, value)]))
                continue
            if kind is EdgeKind.EXIT or kind is EdgeKind.EMIT_AT_END:
                continue  # kept below, once per name
            if kind is EdgeKind.STREAM or kind is EdgeKind.LOOP_STREAM:  # a StreamingGraphEdge
                self._stream(req, inst, e, it, value, out)  # type: ignore[arg-type]
                continue
            if kind is EdgeKind.CARRIED:
                assert lp is not None  # a carried edge is a loop's
                end = inst.loop_end.get(lp.name)
                if end is not None and it >= end:
                    continue
                iteration = it + 1
            else:
                iteration = it if kind is EdgeKind.DIRECT and lp is not None else -1
            targets = [] if kind is EdgeKind.PERSIST else [host(inst.walk, e.dst)]
            if e.persist:
                targets += [g for g in self.persist_targets[(e.dst, e.name)] if g not in targets]
            self._deliver(req, inst, e.dst, e.name, iteration, value, targets, out)
        for name in node_plan.loop_end_outputs:  # a loop node's (lp is set)
            acc = inst.exits.setdefault((node, name), [])
            if name not in lp.accumulate:  # type: ignore[union-attr]
                acc.clear()
            acc.append(outputs[name])
        if node_plan.stream_slot is not None and call.chunk is not None:
            self._took(req, inst, node, node_plan.stream_slot, out)
        if lp is not None:
            self.flush_loop_outputs(req, inst, node, out)

    def after_loop(self, req: RequestCtx, inst: WalkInstance, node: str, outputs: dict, out: Out) -> None:
        """``node`` ran its whole loop (a LoopBodyNode) in one call: ``outputs`` are its last
        iteration's; the loop's exits and at-end emits leave now."""
        lp = inst.plan.nodes[node].loop
        assert lp is not None
        inst.busy.discard(node)
        inst.fired[node] = lp.max_iters
        inst.consume(node, 0)
        for name in inst.plan.nodes[node].loop_end_outputs:
            if name not in outputs:
                raise RequestFailed(grpc.StatusCode.INTERNAL, f"node group '{self.group}': node '{node}' returned no "
                                    f"output '{name}' at the end of its loop '{lp.name}'; it returned {sorted(outputs)}")
            inst.exits[(node, name)] = [outputs[name]]
        self.flush_loop_outputs(req, inst, node, out)

    def _took(self, req: RequestCtx, inst: WalkInstance, node: str, name: str, out: Out, done: bool = False) -> None:
        """A consumer took a chunk of its loop's stream (or, ``done``, stopped taking): tell the
        producer's side; a remote one every max_ahead // 2 chunks, so it never waits long."""
        e = self.loop_streams_in[inst.walk][(node, name)]
        producer = self.placement.host(inst.walk, e.src)
        taken = inst.taken.get(node, 0)
        if producer == self.group:
            inst.credit[(node, name)] = TAKES_ALL if done else taken
        elif done or taken % max(1, e.max_ahead // 2) == 0:
            frame = self._frame(inst, req, K.FRAME_KIND_STREAM_TAKEN, node=node, edge=name, iteration=taken, done=done)
            out.append(Send(producer, frame, []))

    def _stream(self, req: RequestCtx, inst: WalkInstance, e: StreamingGraphEdge, iteration: int,
                value: torch.Tensor, out: Out) -> None:
        """One item of a streaming edge. Colocated: handed over at once. Remote: held until
        it completes a chunk the receiver will cut (or the stream ends), then sent with
        the items held before it in one frame."""
        target = self._stream_host(inst, e)
        if target == self.group:
            self._deliver(req, inst, e.dst, e.name, iteration, value, [target], out)
            return
        held = inst.outbox.get((e.dst, e.name))
        if held is None:
            held = inst.outbox[(e.dst, e.name)] = (Chunker(e.policy, keep_rows=False), [])
        shadow, rows = held
        rows.append(value)
        if shadow.push(value):
            value = _joined(rows)
            rows.clear()
            self._deliver(req, inst, e.dst, e.name, iteration, value, [target], out)

    def _stream_host(self, inst: WalkInstance, e: StreamingGraphEdge) -> str:
        return self.placement.host(e.topology.dst_walk if e.topology is not None else inst.walk, e.dst)

    @staticmethod
    def held_back(inst: WalkInstance, e) -> torch.Tensor | None:
        """The rows of a remote stream not sent yet (they go with its end), or None."""
        held = inst.outbox.pop((e.dst, e.name), None)
        return _joined(held[1]) if held and held[1] else None

    def flush_loop_outputs(self, req: RequestCtx, inst: WalkInstance, node: str, out: Out) -> None:
        """Once a loop node ran its last iteration: send its exit values and end its streams."""
        node_plan = inst.plan.nodes[node]
        lp = node_plan.loop
        if lp is None or node in inst.flushed or not inst.node_finished(node):
            return
        inst.flushed.add(node)
        if node_plan.stream_slot is not None:
            self._took(req, inst, node, node_plan.stream_slot, out, done=True)
        host = self.placement.host
        ends: dict[str, torch.Tensor] = {}  # each name's value at the loop's end, for every edge that reads it
        for name in node_plan.loop_end_outputs:
            values = inst.exits.pop((node, name))
            ends[name] = torch.cat(values) if name in lp.accumulate else values[-1]
        for pe in node_plan.out_edges:
            e = pe.edge
            if pe.kind is EdgeKind.EXIT:
                self._deliver(req, inst, e.dst, e.name, -1, ends[e.name], [host(inst.walk, e.dst)], out)
            elif pe.kind is EdgeKind.EMIT_AT_END:  # ahead of this fragment's FRAGMENT_DONE on the same link
                frame = self._frame(inst, req, K.FRAME_KIND_EMIT, node=node, edge=e.name,
                                    iteration=inst.loop_end.get(lp.name, -1))
                out.append(Send(CONDUCTOR, frame, [(e.name, ends[e.name])]))
            elif pe.kind is EdgeKind.STREAM or pe.kind is EdgeKind.LOOP_STREAM:  # a StreamingGraphEdge
                self._deliver(req, inst, e.dst, e.name, -1, self.held_back(inst, e),
                              [self._stream_host(inst, e)], out, done=True)  # type: ignore[arg-type]

    def fragment_done(self, req: RequestCtx, inst: WalkInstance, out: Out) -> None:
        frame = self._frame(inst, req, K.FRAME_KIND_FRAGMENT_DONE)
        frame.persisted_sent.update(req.persist_sent)
        req.persist_sent = {}
        out.append(Send(CONDUCTOR, frame, []))


def _joined(rows: list[torch.Tensor]) -> torch.Tensor:
    return rows[0] if len(rows) == 1 else torch.cat(rows)
