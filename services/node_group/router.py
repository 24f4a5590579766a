"""Where a node's outputs go: local hand-over, a peer node group, or the conductor.

Colocated destinations get the tensor object itself (no serialization); remote ones
get a DATA frame on the link to the hosting group.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import grpc
import torch

from mstar import metrics
from mstar.config import Placement
from mstar.models.base import Model, NodeCall, NodeSubmodule
from mstar.models.graph import INPUT, StreamingGraphEdge
from mstar.models.plan import EdgeKind
from mstar.services.links import Links
from mstar.services.node_group.fragment import InstanceKey, WalkInstance
from mstar.services.node_group.streams import Chunker
from mstar.v1 import node_group_pb2 as pb

K = SimpleNamespace(**dict(pb.FrameKind.items()))  # plain ints: the enum wrapper's attribute lookup costs ~3 us


class RequestFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Router:
    def __init__(self, group: str, model: Model, placement: Placement, links: Links, spawn: Callable):
        """``spawn(req, parent, dst_walk, edge, chunks)`` starts chunk walks for local stream chunks."""
        self.group, self.model, self.placement, self.links, self.spawn = group, model, placement, links, spawn
        self._local_edges = metrics.EdgeMetrics(group, group)
        host = placement.host
        self.local: dict[str, tuple[str, ...]] = {}
        self.owner_loops: dict[str, frozenset[str]] = {}
        self.loop_peers: dict[tuple[str, str], list[str]] = {}
        self.persisted: dict[str, set[tuple[str, str]]] = {}
        self.inputs: dict[str, list[tuple[str, str]]] = {}  # walk -> (node, input) read here
        self.streams_in: dict[str, dict[tuple[str, str], StreamingGraphEdge]] = {}
        for walk, plan in model.plans.items():
            self.local[walk] = tuple(n for n in plan.nodes if host(walk, n) == group)
            self.owner_loops[walk] = frozenset(lp for lp in plan.loops if placement.loop_owner(walk, lp) == group)
            for lp in plan.loops.values():
                self.loop_peers[(walk, lp.name)] = sorted({host(walk, n) for n in lp.nodes} - {group})
            self.persisted[walk] = {(e.dst, e.name) for e in plan.walk.edges if e.persist}
            self.inputs[walk] = [(e.dst, e.name) for e in plan.walk.edges if e.src == INPUT and e.dst in self.local[walk]]
            self.streams_in[walk] = {(e.dst, e.name): e for e in plan.streams
                                     if host(e.topology.dst_walk, e.dst) == group}

        self.persist_targets = {(e.dst, e.name): placement.persist_targets(e.dst, e.name)
                                for plan in model.plans.values() for e in plan.walk.edges if e.persist}

    def new_instance(self, key: InstanceKey) -> WalkInstance:
        walk = key[0]
        return WalkInstance(key, self.model.plans[walk], self.local[walk], self.owner_loops[walk],
                            open_streams=len(self.streams_in[walk]) if key[2] < 0 else 0)

    # -- in ------------------------------------------------------------------------------
    def accept(self, req, inst: WalkInstance, node: str, edge: str, iteration: int,
               value: torch.Tensor | None, done: bool) -> None:
        walk = inst.walk
        if value is not None and (node, edge) in self.persisted[walk]:
            req.persisted[(node, edge)] = value
            req.persist_received += 1
        stream = self.streams_in[walk].get((node, edge))
        if stream is not None:
            chunker = inst.chunkers.get((node, edge))
            if chunker is None:
                chunker = inst.chunkers[(node, edge)] = Chunker(stream.policy)
            chunks = chunker.push(value) if value is not None else []
            if done:
                chunks += chunker.finish()
                inst.open_streams -= 1
            self.spawn(req, inst, stream.topology.dst_walk, edge, chunks)
        elif node in inst.plan.nodes and value is not None and self.placement.host(walk, node) == self.group:
            inst.put(node, edge, iteration, value)

    # -- out -----------------------------------------------------------------------------
    def _link(self, req, group: str):
        """The link to the replica of ``group`` this request is pinned to."""
        try:
            return self.links.route(group, req.routes)
        except KeyError as e:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"node group '{self.group}': {e.args[0]}") from None

    def _frame(self, inst: WalkInstance, req, kind, **kw) -> pb.Frame:
        return pb.Frame(kind=kind, request_id=req.request_id, walk=inst.walk, walk_seq=inst.key[1],
                        chunk_index=inst.key[2], parent_walk_seq=-1, **kw)

    def deliver(self, req, inst: WalkInstance, dst: str, name: str, iteration: int, value,
                targets: list[str], done: bool = False) -> None:
        persisted = value is not None and (dst, name) in self.persisted[inst.walk]
        for target in targets:
            if persisted:
                req.persist_sent[target] = req.persist_sent.get(target, 0) + 1
            if target == self.group:
                if value is not None:
                    self._local_edges.sent(name, "local", value.nbytes, 0.0)
                self.accept(req, inst, dst, name, iteration, value, done)
            else:
                frame = self._frame(inst, req, K.FRAME_KIND_DATA, node=dst, edge=name, iteration=iteration, done=done)
                self._link(req, target).send(frame, [(name, value)] if value is not None else [])

    def after_fire(self, req, inst: WalkInstance, node: str, call: NodeCall, outputs: dict, sub: NodeSubmodule) -> None:
        plan, it = inst.plan, call.iteration
        if not isinstance(outputs, dict):
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"node group '{self.group}': node '{node}' returned "
                                f"{type(outputs).__name__} for a call; a call's outputs are a dict of name -> torch.Tensor")
        inst.fired[node] = inst.fired.get(node, 0) + 1
        inst.consume(node, it)
        node_plan = plan.nodes[node]
        lp = node_plan.loop
        if lp is not None and lp.stop_node == node and lp.name in inst.owner_loops:
            if sub.check_stop(call, outputs) or it + 1 >= lp.max_iters:
                inst.end_loop(lp.name, it)
                for peer in self.loop_peers[(inst.walk, lp.name)]:
                    self._link(req, peer).send(self._frame(inst, req, K.FRAME_KIND_LOOP_END, node=node, iteration=it))
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
                self.links["conductor"].send(frame, [(e.name, value)])
                continue
            if kind is EdgeKind.EXIT or kind is EdgeKind.EMIT_AT_END:
                continue  # kept below, once per name
            if kind is EdgeKind.STREAM:
                self.stream(req, inst, e, it, value)
                continue
            if kind is EdgeKind.CARRIED:
                end = inst.loop_end.get(lp.name)
                if end is not None and it >= end:
                    continue
                iteration = it + 1
            else:
                iteration = it if kind is EdgeKind.DIRECT and lp is not None else -1
            targets = [] if kind is EdgeKind.PERSIST else [host(inst.walk, e.dst)]
            if e.persist:
                targets += [g for g in self.persist_targets[(e.dst, e.name)] if g not in targets]
            self.deliver(req, inst, e.dst, e.name, iteration, value, targets)
        for name in node_plan.loop_end_outputs:
            acc = inst.exits.setdefault((node, name), [])
            if name not in lp.accumulate:
                acc.clear()
            acc.append(outputs[name])
        if lp is not None:
            self.flush_loop_outputs(req, inst, node)

    def stream(self, req, inst: WalkInstance, e: StreamingGraphEdge, iteration: int, value: torch.Tensor) -> None:
        """One item of a streaming edge. Colocated: handed over at once. Remote: held until
        it completes a chunk the receiver will cut (or the stream ends), then sent with
        the items held before it in one frame."""
        target = self.placement.host(e.topology.dst_walk, e.dst)
        if target == self.group:
            self.deliver(req, inst, e.dst, e.name, iteration, value, [target])
            return
        held = inst.outbox.get((e.dst, e.name))
        if held is None:
            held = inst.outbox[(e.dst, e.name)] = (Chunker(e.policy, keep_rows=False), [])
        shadow, rows = held
        rows.append(value)
        if shadow.push(value):
            value = _joined(rows)
            rows.clear()
            self.deliver(req, inst, e.dst, e.name, iteration, value, [target])

    @staticmethod
    def held_back(inst: WalkInstance, e) -> torch.Tensor | None:
        """The rows of a remote stream not sent yet (they go with its end), or None."""
        held = inst.outbox.pop((e.dst, e.name), None)
        return _joined(held[1]) if held and held[1] else None

    def flush_loop_outputs(self, req, inst: WalkInstance, node: str) -> None:
        """Once a loop node ran its last iteration: send its exit values and end its streams."""
        node_plan = inst.plan.nodes[node]
        lp = node_plan.loop
        if lp is None or node in inst.flushed or not inst.node_finished(node):
            return
        inst.flushed.add(node)
        host = self.placement.host
        ends: dict[str, torch.Tensor] = {}  # each name's value at the loop's end, for every edge that reads it
        for name in node_plan.loop_end_outputs:
            values = inst.exits.pop((node, name))
            ends[name] = torch.cat(values) if name in lp.accumulate else values[-1]
        for pe in node_plan.out_edges:
            e = pe.edge
            if pe.kind is EdgeKind.EXIT or pe.kind is EdgeKind.EMIT_AT_END:
                value = ends[e.name]
                if pe.kind is EdgeKind.EXIT:
                    self.deliver(req, inst, e.dst, e.name, -1, value, [host(inst.walk, e.dst)])
                else:  # ahead of this fragment's FRAGMENT_DONE on the same link: postprocess sees it first
                    frame = self._frame(inst, req, K.FRAME_KIND_EMIT, node=node, edge=e.name,
                                        iteration=inst.loop_end.get(lp.name, -1))
                    self.links["conductor"].send(frame, [(e.name, value)])
            elif pe.kind is EdgeKind.STREAM:
                self.deliver(req, inst, e.dst, e.name, -1, self.held_back(inst, e), [host(e.topology.dst_walk, e.dst)],
                             done=True)

    def fragment_done(self, req, inst: WalkInstance) -> None:
        frame = self._frame(inst, req, K.FRAME_KIND_FRAGMENT_DONE)
        frame.persisted_sent.update(req.persist_sent)
        req.persist_sent = {}
        self.links["conductor"].send(frame)



def _joined(rows: list[torch.Tensor]) -> torch.Tensor:
    return rows[0] if len(rows) == 1 else torch.cat(rows)
