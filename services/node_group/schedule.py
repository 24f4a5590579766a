"""What can fire: ready node calls queued per (walk, node), batched round-robin."""

from __future__ import annotations

from collections import deque

from mstar.models.base import NodeCall, NodeSubmodule
from mstar.services.node_group.fragment import WalkInstance
from mstar.services.node_group.requests import Pending, RequestCtx
from mstar.services.node_group.router import Out, Router

Key = tuple[str, str]  # (walk, node)


class Schedule:
    def __init__(self, router: Router, submodules: dict[str, NodeSubmodule]):
        self.router, self.submodules = router, submodules
        self.ready: dict[Key, deque[Pending]] = {}
        self._order: deque[Key] = deque()

    def advance(self, req: RequestCtx, inst: WalkInstance, out: Out) -> bool:
        """Queue every node of the instance that can fire (True if any); once the instance is
        finished, drop it and tell its parent (a chunk walk) or the conductor (a fragment)."""
        if req.kwargs is None:
            return False  # START_WALK (with the request's kwargs) has not arrived yet
        queued = False
        for node in inst.local:
            nxt = inst.next_call(node)
            if nxt is not None:
                inst.busy.add(node)
                key = (inst.walk, node)
                q = self.ready.get(key)
                if q is None:
                    q = self.ready[key] = deque()
                    self._order.append(key)
                q.append(Pending(req.request_id, inst.key, *nxt))
                queued = True
        if inst.finished() and req.instances.get(inst.key) is inst:
            del req.instances[inst.key]
            if inst.parent is not None:
                parent = req.instances[inst.parent]
                parent.children -= 1
                queued = self.advance(req, parent, out) or queued
            else:
                self.router.fragment_done(req, inst, out)
        return queued

    def next_calls(self, taken: set[Key], requests: dict[str, RequestCtx]):
        """The next batch as node calls: (walk, node, calls, where) with ``where`` each call's
        (request, instance); None when no (walk, node) outside ``taken`` has one ready."""
        nxt = self.next_batch(taken)
        if nxt is None:
            return None
        (walk, node), batch = nxt
        calls, where = [], []
        for p in batch:
            req = requests.get(p.request_id)
            if req is None or (inst := req.instances.get(p.key)) is None:
                continue  # released while queued
            calls.append(NodeCall(p.request_id, walk, p.iteration, p.inputs, req.kwargs or {},
                                  req.node_state.setdefault(node, {}), p.chunk or inst.chunk))
            where.append((req, inst))
        return walk, node, calls, where

    def next_batch(self, taken: set[Key]) -> tuple[Key, list[Pending]] | None:
        """The next ready batch of a (walk, node) not in ``taken`` (this round's), round-robin."""
        for _ in range(len(self._order)):
            key = self._order[0]
            self._order.rotate(-1)  # round-robin over (walk, node) for fairness
            q = self.ready[key]
            if q and key not in taken:
                taken.add(key)
                n = min(len(q), self.submodules[key[1]].max_batch)
                return key, [q.popleft() for _ in range(n)]
        return None

    def __len__(self) -> int:
        return sum(map(len, list(self.ready.values())))

    def clear(self) -> None:
        self.ready.clear()
        self._order.clear()
