"""One walk instance as seen by one node group: its fragment of the walk.

Pure bookkeeping, no I/O: which values have arrived, which node can fire at which
iteration, when loops end, when the fragment is finished. Values are keyed
(node, input name, iteration); iteration -1 means "outside loops / constant".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from mstar.models.base import ChunkInfo
from mstar.models.chunker import Chunk, Chunker
from mstar.models.plan import WalkPlan

#: a consumer whose loop ended takes no more: its producer is not held back any longer
TAKES_ALL = 1 << 62

InstanceKey = tuple[str, int, int]  # (walk, walk_seq, chunk_index); chunk_index -1 unless a chunk walk


@dataclass
class WalkInstance:
    key: InstanceKey
    plan: WalkPlan
    local: tuple[str, ...]  # nodes of this walk hosted here, in body order
    owner_loops: frozenset[str]  # loops whose stop decision is made here
    open_streams: int  # inbound streaming edges not yet finished
    started: bool = False
    chunk: ChunkInfo | None = None
    parent: InstanceKey | None = None
    values: dict[tuple[str, str, int], torch.Tensor] = field(default_factory=dict)
    fired: dict[str, int] = field(default_factory=dict)
    busy: set[str] = field(default_factory=set)
    loop_end: dict[str, int] = field(default_factory=dict)
    decided: dict[str, int] = field(default_factory=dict)  # owner: iterations known to continue
    exits: dict[tuple[str, str], list[torch.Tensor]] = field(default_factory=dict)
    chunkers: dict[tuple[str, str], Chunker] = field(default_factory=dict)  # (node, edge)
    # outbound streams to another group: the receiver's chunker shadowed, and rows held back
    outbox: dict[tuple[str, str], tuple[Chunker, list[torch.Tensor]]] = field(default_factory=dict)
    children: int = 0
    flushed: set[str] = field(default_factory=set)  # loop nodes whose exits/stream ends went out
    # streams into a running loop, consumer side: chunks not taken yet, chunks taken, ended streams
    inflow: dict[str, deque[Chunk]] = field(default_factory=dict)  # consumer node -> chunks
    taken: dict[str, int] = field(default_factory=dict)  # consumer node -> chunks taken so far
    stream_ended: set[str] = field(default_factory=set)  # consumer nodes whose stream's producer finished
    # producer side: chunks each consumer (dst, edge) has taken, as last heard
    credit: dict[tuple[str, str], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for lp in self.plan.loops.values():
            self.decided[lp.name] = 0
            if lp.stop_node is None:  # only max_iters can end it: everyone knows when
                self.loop_end[lp.name] = lp.max_iters - 1
                self.decided[lp.name] = lp.max_iters

    @property
    def walk(self) -> str:
        return self.key[0]

    def put(self, node: str, name: str, iteration: int, value: torch.Tensor) -> None:
        lp = self.plan.nodes[node].loop if node in self.plan.nodes else None
        end = self.loop_end.get(lp.name) if lp is not None else None
        if end is not None and iteration > end:
            return  # carried value for an iteration that will not run
        self.values[(node, name, iteration)] = value

    def next_call(self, node: str) -> tuple[int, dict[str, torch.Tensor], ChunkInfo | None] | None:
        """The iteration ``node`` can fire at now, with its inputs and the stream chunk it
        takes (a node fed by a stream into its running loop); None if not ready."""
        if not self.started or node in self.busy:
            return None
        np_ = self.plan.nodes[node]
        for e in np_.streams_out:  # back-pressure: the consumer is max_ahead chunks behind
            if self._cut(e.dst, e.name) - self.credit.get((e.dst, e.name), 0) >= e.max_ahead:
                return None
        lp, i = np_.loop, self.fired.get(node, 0)
        if lp is None:
            if i:
                return None
            it = -1
        else:
            end = self.loop_end.get(lp.name)
            if end is not None and i > end:
                return None
            if i > 0 and lp.name in self.owner_loops and self.decided[lp.name] < i:
                return None
            it = i
        inputs = {}
        for name in np_.constant_slots:
            v = self.values.get((node, name, -1))
            if v is None:
                return None
            inputs[name] = v
        if it == 0:
            for name in np_.once_slots:
                v = self.values.get((node, name, -1))
                if v is None:
                    return None
                inputs[name] = v
        for name in np_.iteration_slots:
            v = self.values.get((node, name, it))
            if v is None:
                return None
            inputs[name] = v
        if it > 0:
            for name in np_.carried_slots:
                v = self.values.get((node, name, it))
                if v is None:
                    return None
                inputs[name] = v
        chunk = None
        if np_.stream_slot is not None:
            q = self.inflow.get(node)
            if q:
                chunk, inputs[np_.stream_slot] = q.popleft()
                self.taken[node] = self.taken.get(node, 0) + 1
            elif node not in self.stream_ended:
                return None  # caught up with the producer: wait for its next chunk
        return it, inputs, chunk

    def _cut(self, dst: str, name: str) -> int:
        """Chunks cut so far of the stream into ``dst`` (its chunker here, or the shadow of a remote one)."""
        chunker = self.chunkers.get((dst, name))
        if chunker is None:
            held = self.outbox.get((dst, name))
            chunker = held[0] if held else None
        return chunker.chunks if chunker is not None else 0

    def consume(self, node: str, iteration: int) -> None:
        np_ = self.plan.nodes[node]
        for name in np_.iteration_slots | np_.carried_slots:
            self.values.pop((node, name, iteration), None)
        if iteration == 0:
            for name in np_.once_slots:  # read by the first iteration only
                self.values.pop((node, name, -1), None)

    def end_loop(self, loop: str, last: int) -> None:
        self.loop_end[loop] = last
        nodes = set(self.plan.loops[loop].nodes)
        for k in [k for k in self.values if k[0] in nodes and k[2] > last]:
            del self.values[k]

    def node_finished(self, node: str) -> bool:
        lp = self.plan.nodes[node].loop
        if lp is None:
            return self.fired.get(node, 0) >= 1
        end = self.loop_end.get(lp.name)
        return end is not None and self.fired.get(node, 0) >= end + 1

    def finished(self) -> bool:
        return (self.started and self.open_streams == 0 and self.children == 0 and not self.busy
                and all(self.node_finished(n) for n in self.local))
