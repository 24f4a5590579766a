"""Walk analysis: turns a declared Walk into the facts the runtime routes by.

Validation happens here, once, at load; errors say what to change.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

from mstar.models.graph import (
    EMIT_TO_CLIENT,
    EMIT_TO_CONDUCTOR,
    INPUT,
    GraphEdge,
    GraphError,
    GraphNode,
    Loop,
    Parallel,
    Sequential,
    Step,
    StreamingGraphEdge,
    Walk,
)


class EdgeKind(enum.Enum):
    INPUT = "input"  # walk input -> node (constant over loop iterations)
    DIRECT = "direct"  # same iteration (or no loop)
    ENTRY = "entry"  # outside a loop -> loop node (constant over iterations)
    CARRIED = "carried"  # loop node -> same-or-earlier loop node, next iteration
    EXIT = "exit"  # loop node -> node after the loop, once at loop end
    EMIT = "emit"  # -> client / conductor, at every firing
    EMIT_AT_END = "emit_at_end"  # loop node -> client / conductor, once at loop end
    STREAM = "stream"  # -> a chunk walk, item per firing
    LOOP_STREAM = "loop_stream"  # loop node -> a node of another loop of the walk, which takes a chunk per iteration
    PERSIST = "persist"  # -> a node of a later walk only (value is stored)


@dataclass(frozen=True)
class LoopPlan:
    name: str
    max_iters: int
    stop_node: str | None
    accumulate: frozenset[str]
    nodes: tuple[str, ...]  # in body order


@dataclass(frozen=True)
class PlannedEdge:
    edge: GraphEdge
    kind: EdgeKind


@dataclass
class NodePlan:
    name: str
    order: int
    loop: LoopPlan | None
    in_edges: list[PlannedEdge] = field(default_factory=list)
    out_edges: list[PlannedEdge] = field(default_factory=list)

    @cached_property
    def constant_slots(self) -> set[str]:
        """Inputs from outside the loop, the same for every iteration (``once`` ones excepted)."""
        return {p.edge.name for p in self.in_edges if p.kind in (EdgeKind.INPUT, EdgeKind.ENTRY) and not p.edge.once}

    @cached_property
    def once_slots(self) -> set[str]:
        """Inputs from outside the loop that only its first iteration reads (``GraphEdge.once``)."""
        return {p.edge.name for p in self.in_edges if p.kind in (EdgeKind.INPUT, EdgeKind.ENTRY) and p.edge.once}

    @cached_property
    def iteration_slots(self) -> set[str]:
        """Inputs produced anew for every firing (same iteration, or loop exits)."""
        return {p.edge.name for p in self.in_edges if p.kind in (EdgeKind.DIRECT, EdgeKind.EXIT)}

    @cached_property
    def carried_slots(self) -> set[str]:
        return {p.edge.name for p in self.in_edges if p.kind is EdgeKind.CARRIED}

    @cached_property
    def stream_slot(self) -> str | None:
        """The input this node takes a chunk of per iteration (a stream into its running loop)."""
        return next((p.edge.name for p in self.in_edges if p.kind is EdgeKind.LOOP_STREAM), None)

    @cached_property
    def streams_out(self) -> tuple[StreamingGraphEdge, ...]:
        """Streams from this node into another running loop (each may hold it back)."""
        return tuple(p.edge for p in self.out_edges if p.kind is EdgeKind.LOOP_STREAM)  # type: ignore[misc]

    @cached_property
    def loop_end_outputs(self) -> tuple[str, ...]:
        """Outputs kept for the loop's end (exits, emits at the loop's end), each name once
        however many edges read it."""
        return tuple(dict.fromkeys(p.edge.name for p in self.out_edges if p.kind in (EdgeKind.EXIT, EdgeKind.EMIT_AT_END)))


@dataclass
class WalkPlan:
    walk: Walk
    nodes: dict[str, NodePlan]
    loops: dict[str, LoopPlan]

    @property
    def name(self) -> str:
        return self.walk.name

    @property
    def input_names(self) -> set[str]:
        return {e.name for e in self.walk.edges if e.src == INPUT}

    @property
    def emits(self) -> list[GraphEdge]:
        """Edges to the client (the model's outputs)."""
        return [e for e in self.walk.edges if e.dst == EMIT_TO_CLIENT]

    @property
    def conductor_emits(self) -> list[GraphEdge]:
        """Edges to the model's state machine only."""
        return [e for e in self.walk.edges if e.dst == EMIT_TO_CONDUCTOR]

    @property
    def streams(self) -> list[StreamingGraphEdge]:
        """Streams cut into chunk walks (``PartitionTopology``)."""
        return [e for e in self.walk.edges if isinstance(e, StreamingGraphEdge) and e.topology is not None]

    @property
    def loop_streams(self) -> list[StreamingGraphEdge]:
        """Streams into another running loop of this walk."""
        return [e for e in self.walk.edges if isinstance(e, StreamingGraphEdge) and e.topology is None]


def _flatten(step: Step, walk: str, loop: Loop | None, out: list[tuple[str, Loop | None]]) -> None:
    if isinstance(step, str):
        out.append((step, loop))
    elif isinstance(step, Sequential):
        for s in step.steps:
            _flatten(s, walk, loop, out)
    elif isinstance(step, Parallel):
        for s in step.branches:
            _flatten(s, walk, loop, out)
    elif isinstance(step, Loop):
        if loop is not None:
            raise GraphError(f"walk '{walk}': loop '{step.name}' is nested in loop '{loop.name}'; nested loops are not supported — flatten them into one Loop")
        if step.max_iters < 1:
            raise GraphError(f"walk '{walk}': loop '{step.name}' has max_iters={step.max_iters}; a loop needs max_iters >= 1 so it always exits")
        _flatten(step.body, walk, step, out)
    else:
        raise GraphError(f"walk '{walk}': unknown body element {step!r}; use a node name, Sequential, Parallel or Loop")


def plan_walk(walk: Walk, nodes: dict[str, GraphNode], walks: dict[str, Walk]) -> WalkPlan:
    flat: list[tuple[str, Loop | None]] = []
    _flatten(walk.body, walk.name, None, flat)
    plans: dict[str, NodePlan] = {}
    loops: dict[str, LoopPlan] = {}
    for order, (name, loop) in enumerate(flat):
        if name not in nodes:
            raise GraphError(f"walk '{walk.name}': unknown node '{name}'. Known nodes: {', '.join(sorted(nodes))}")
        if name in plans:
            raise GraphError(f"walk '{walk.name}': node '{name}' appears twice in the body; a node runs once per walk (or once per loop iteration)")
        lp = None
        if loop is not None:
            lp = loops.get(loop.name)
            if lp is None:
                members = tuple(n for n, lo in flat if lo is loop)
                if loop.stop_node is not None and loop.stop_node not in members:
                    raise GraphError(f"walk '{walk.name}': loop '{loop.name}' stop_node '{loop.stop_node}' is not in the loop body {list(members)}")
                lp = LoopPlan(loop.name, loop.max_iters, loop.stop_node, frozenset(loop.accumulate), members)
                loops[loop.name] = lp
        plans[name] = NodePlan(name, order, lp)

    seen_slots: dict[tuple[str, str], EdgeKind] = {}
    for e in walk.edges:
        kind = _classify(walk, e, plans, walks)
        pe = PlannedEdge(e, kind)
        if e.src != INPUT:
            plans[e.src].out_edges.append(pe)
        if e.dst in plans:
            key = (e.dst, e.name)
            prev = seen_slots.get(key)
            pair = {prev, kind}
            if prev is not None and not (kind is EdgeKind.CARRIED) ^ (prev is EdgeKind.CARRIED):
                raise GraphError(f"walk '{walk.name}': node '{e.dst}' receives '{e.name}' from two edges; only a loop's initial value and its carried value may share a name")
            if prev is not None and not pair & {EdgeKind.INPUT, EdgeKind.ENTRY}:
                raise GraphError(f"walk '{walk.name}': carried input '{e.name}' of '{e.dst}' can only share its name with an initial value from outside the loop")
            seen_slots[key] = kind
            if kind is not EdgeKind.PERSIST:
                plans[e.dst].in_edges.append(pe)
    for np_ in plans.values():
        if sum(p.kind is EdgeKind.LOOP_STREAM for p in np_.in_edges) > 1:
            raise GraphError(f"walk '{walk.name}': node '{np_.name}' takes two streams into its loop; a loop node takes "
                             f"one stream's chunk per iteration — merge the streams in the producer")
    for lp in loops.values():
        for acc in lp.accumulate:
            if not any(p.edge.name == acc and p.kind in (EdgeKind.EXIT, EdgeKind.EMIT_AT_END)
                       for n in lp.nodes for p in plans[n].out_edges):
                raise GraphError(f"walk '{walk.name}': loop '{lp.name}' accumulates '{acc}' but no edge named '{acc}' leaves the loop")
    return WalkPlan(walk, plans, loops)


def _classify(walk: Walk, e: GraphEdge, plans: dict[str, NodePlan], walks: dict[str, Walk]) -> EdgeKind:
    where = f"walk '{walk.name}': edge '{e.name}' ({e.src} -> {e.dst})"
    if e.src == INPUT:
        if e.dst not in plans:
            raise GraphError(f"{where}: a walk input must go to a node of the walk; '{e.dst}' does not run in it")
        if e.once and plans[e.dst].loop is None:
            raise GraphError(f"{where}: once=True is for a value entering a Loop (read by its first iteration only); "
                             f"'{e.dst}' runs outside any loop")
        return EdgeKind.INPUT
    if e.src not in plans:
        raise GraphError(f"{where} starts at '{e.src}', which does not run in this walk — add it to the body or remove the edge")
    if e.at_loop_end and e.dst not in (EMIT_TO_CLIENT, EMIT_TO_CONDUCTOR):
        raise GraphError(f"{where}: at_loop_end is for edges to EMIT_TO_CLIENT or EMIT_TO_CONDUCTOR; an edge from a "
                         f"loop node to a node after the loop already fires once, when the loop ends")
    if e.dst in (EMIT_TO_CLIENT, EMIT_TO_CONDUCTOR):
        if e.dst == EMIT_TO_CLIENT and e.modality is None:
            raise GraphError(f"{where}: an edge to EMIT_TO_CLIENT needs a modality")
        if not e.at_loop_end:
            return EdgeKind.EMIT
        if plans[e.src].loop is None:
            raise GraphError(f"{where}: at_loop_end needs '{e.src}' inside a Loop (outside one, an emit fires once anyway)")
        return EdgeKind.EMIT_AT_END
    if isinstance(e, StreamingGraphEdge) and e.topology is None:
        return _classify_loop_stream(where, e, plans)
    if isinstance(e, StreamingGraphEdge):
        topo = e.topology
        if topo is None or topo.src_walk != walk.name:
            raise GraphError(f"{where}: a streaming edge needs topology=PartitionTopology(src_walk='{walk.name}', dst_walk=...)")
        dst_walk = walks.get(topo.dst_walk)
        if dst_walk is None:
            raise GraphError(f"{where}: PartitionTopology dst_walk '{topo.dst_walk}' is not a walk of the model. Walks: {', '.join(sorted(walks))}")
        if not any(d.src == INPUT and d.dst == e.dst and d.name == e.name for d in dst_walk.edges):
            raise GraphError(f"{where}: chunk walk '{topo.dst_walk}' needs an edge GraphEdge(INPUT, '{e.dst}', '{e.name}') to receive the chunks")
        if plans[e.src].loop is None:
            raise GraphError(f"{where}: a streaming edge must start inside a Loop (it carries one item per iteration)")
        return EdgeKind.STREAM
    src, dst = plans[e.src], plans.get(e.dst)
    if e.once and (dst is None or dst.loop is None or src.loop is dst.loop):
        raise GraphError(f"{where}: once=True is for a value entering a Loop from outside it (read by its first "
                         f"iteration only); '{e.dst}' takes it {'outside any loop' if dst and dst.loop is None else 'inside its loop'}")
    if e.persist and e.src == e.dst and src.loop is None:
        return EdgeKind.PERSIST  # a node keeps a value for its own use in a later walk
    if dst is None:
        if not e.persist:
            raise GraphError(f"{where} goes to '{e.dst}', which does not run in this walk; mark it persist=True to keep the value for a later walk, or add '{e.dst}' to the body")
        return EdgeKind.PERSIST
    if src.loop is not None and src.loop is dst.loop:
        return EdgeKind.DIRECT if dst.order > src.order else EdgeKind.CARRIED
    if dst.order <= src.order:
        raise GraphError(f"{where} goes backwards outside a loop; reorder the body so '{e.src}' runs before '{e.dst}'")
    if src.loop is None and dst.loop is None:
        return EdgeKind.DIRECT
    if src.loop is None:
        return EdgeKind.ENTRY
    if dst.loop is None:
        return EdgeKind.EXIT
    raise GraphError(f"{where} connects two different loops; route it through a node between them")


def _classify_loop_stream(where: str, e: StreamingGraphEdge, plans: dict[str, NodePlan]) -> EdgeKind:
    """A stream into a running loop: both ends in loops of this walk, the consumer's after the producer's."""
    src, dst = plans[e.src], plans.get(e.dst)
    hint = ("a stream without topology feeds a running loop of the same walk; give topology=PartitionTopology(...) "
            "to run a chunk walk per chunk instead")
    if dst is None:
        raise GraphError(f"{where}: '{e.dst}' does not run in this walk; {hint}")
    if src.loop is None or dst.loop is None:
        raise GraphError(f"{where}: both ends must be inside Loops (the producer streams one item per iteration, "
                         f"the consumer takes one chunk per iteration); {hint}")
    if src.loop is dst.loop:
        raise GraphError(f"{where}: producer and consumer are in the same loop '{src.loop.name}'; a value for the "
                         f"next iteration of the same loop is a plain (carried) GraphEdge")
    if dst.order <= src.order:
        raise GraphError(f"{where}: the consuming loop '{dst.loop.name}' comes before the producing loop "
                         f"'{src.loop.name}' in the body; put the producer first (e.g. Parallel(producer, consumer))")
    return EdgeKind.LOOP_STREAM
