"""The node-group runtime: frames in, ready nodes batched and executed, outputs routed.

The main loop reads like the design: schedule -> execute -> update.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace

import grpc
import torch

from mstar import metrics
from mstar.config import Placement
from mstar.env import settings
from mstar.models.base import EngineNode, Model, NodeCall, NodeContext, NodeSubmodule
from mstar.services.engines.tensor_parallel import TPSpec
from mstar.services.links import Links
from mstar.services.node_group.fragment import InstanceKey, WalkInstance
from mstar.services.node_group.router import RequestFailed, Router
from mstar.services.transport import Protocol
from mstar.services.transport.location import local_location
from mstar.v1 import node_group_pb2 as pb

log = logging.getLogger(__name__)
K = SimpleNamespace(**dict(pb.FrameKind.items()))  # plain ints: the enum wrapper's attribute lookup costs ~3 us
MAX_TOMBSTONES = 100_000


def create_submodules(model: Model, placement: Placement, group: str, device: str, cache_dir: str | None,
                      tp: TPSpec | None = None) -> dict[str, NodeSubmodule]:
    """The group's nodes; with ``tp``, each must join the tensor-parallel ranks."""
    cfg = placement.config.group(group)
    subs = {n: model.create_submodule(NodeContext(n, device, cache_dir, placement.config.model_kwargs, tp))
            for n in cfg.node_names}
    if tp is not None:
        for n, sub in subs.items():
            if not isinstance(sub, EngineNode) or sub.tensor_parallel is None:
                raise ValueError(f"node group '{group}' has tp_size={tp.size}, but node '{n}' of model "
                                 f"'{model.name}' does not run tensor-parallel; use tp_size 1")
    return subs


@dataclass
class RequestCtx:
    request_id: str
    kwargs: dict | None = None
    persisted: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    node_state: dict[str, dict] = field(default_factory=dict)
    instances: dict[InstanceKey, WalkInstance] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)  # group -> replica address this request is pinned to
    persist_received: int = 0  # persisted values stored, local and remote
    persist_sent: dict[str, int] = field(default_factory=dict)  # since the last FRAGMENT_DONE, by group
    parked: list[tuple[WalkInstance, int, dict]] = field(default_factory=list)  # starts waiting for persisted values


@dataclass
class Pending:
    request_id: str
    key: InstanceKey
    iteration: int
    inputs: dict[str, torch.Tensor]


class NodeGroupRuntime:
    def __init__(self, group: str, model: Model, placement: Placement, peers: dict[str, str | list[str]],
                 conductor: str, protocol: Protocol, device: str = "cpu", cache_dir: str | None = None,
                 tp: TPSpec | None = None):
        """``tp``: rank 0's place in the group's tensor-parallel ranks (tp_size > 1)."""
        self.group, self.model, self.placement = group, model, placement
        self.submodules = create_submodules(model, placement, group, device, cache_dir, tp)
        self.location = local_location(group, device)
        self.links = Links(group, protocol, self._on_link_down)
        for peer, address in peers.items():  # defaults for frames that carry no route
            if isinstance(address, list):
                address = address[0] if len(address) == 1 else None
            if peer != group and address:
                self.links.add(peer, address)
        self.links.add("conductor", conductor, kind="report")
        self.router = Router(group, model, placement, self.links, spawn=self._spawn_chunks)
        self.requests: dict[str, RequestCtx] = {}
        self.released: OrderedDict[str, None] = OrderedDict()
        self.ready: dict[tuple[str, str], deque[Pending]] = {}
        self._order: deque[tuple[str, str]] = deque()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{group}-forward")
        self.engines = {n: s for n, s in self.submodules.items() if isinstance(s, EngineNode)}
        #: A group without engines may run back-to-back rounds (a loop iterating, many requests
        #: ready) for up to this long (MSTAR_ROUND_BUDGET_S) before it yields to the event loop,
        #: instead of after each round. The frames those rounds produce then leave as one message
        #: per link, not one per round (each costs ~100 µs of CPU on either side); arriving frames
        #: and the link writers wait at most that long. The first round after an idle wait yields
        #: at once. Off by default (0): on the 2-core VM (bench/results/mesh-round-budget/,
        #: interleaved runs) 0.5 ms raised one stream's events/s (gRPC +23-54%, gateway +11-62%)
        #: but lowered eight streams' through the gateway by ~25%: frames held in one stage leave
        #: the next one idle. Groups with engines always yield every round (0 here): a finished
        #: engine step is seen only when the loop runs, and its next step waits for that.
        self.round_budget_s = 0.0 if self.engines else settings().round_budget_s
        # engines are only touched on their worker thread: submits and releases wait in
        # these lists until the next step is launched
        self._inbox: dict[str, list[NodeCall]] = {n: [] for n in self.engines}
        self._engine_releases: dict[str, list[str]] = {n: [] for n in self.engines}
        self._engine_step: dict[str, asyncio.Future | None] = {n: None for n in self.engines}
        self._engine_executor = ThreadPoolExecutor(max_workers=max(1, len(self.engines)), thread_name_prefix=f"{group}-engine")
        self._in_engine: dict[int, tuple[NodeCall, RequestCtx, WalkInstance, str]] = {}  # id(call) -> call, where, node
        self.steps = 0  # batches executed
        self.calls = 0  # node calls executed (calls / steps = mean batch size)
        self.metrics = metrics.GroupMetrics(group, lambda: sum(map(len, list(self.ready.values()))), lambda: len(self.requests))

    # -- frames in -----------------------------------------------------------------------
    def on_batch(self, batch: pb.FrameBatch, decoded: list) -> None:
        """Frames of one batch with their tensors (``TensorReceiver.decode_batch``: a list
        per frame, or the exception decoding it raised)."""
        for frame, tensors in zip(batch.frames, decoded, strict=True):
            if frame.kind == K.FRAME_KIND_UNSPECIFIED:
                continue  # the hello frame that opens a stream
            rid = frame.request_id
            if rid in self.released:
                continue  # pooled buffers were acknowledged while decoding
            if isinstance(tensors, Exception):  # a transport failure ends this request, not the stream
                self.fail(rid, grpc.StatusCode.INTERNAL, f"node group '{self.group}': cannot decode a tensor sent by "
                          f"'{batch.sender}': {type(tensors).__name__}: {tensors}")
                continue
            try:
                self._on_frame(frame, {t.name: v for t, v in zip(frame.tensors, tensors, strict=True)})
            except RequestFailed as e:
                self.fail(rid, e.code, e.message)
            except Exception as e:  # a bug here must end this request, not the peer's stream (and its other requests)
                self._failed_on_bug([rid], f"handling a frame from '{batch.sender}'", e)

    def _on_frame(self, f: pb.Frame, tensors: dict[str, torch.Tensor]) -> None:
        if f.kind == K.FRAME_KIND_RELEASE:
            self.release(f.request_id)
            return
        req = self.requests.get(f.request_id) or self.requests.setdefault(f.request_id, RequestCtx(f.request_id))
        if f.request_kwargs_json and req.kwargs is None:
            req.kwargs = json.loads(f.request_kwargs_json)
        inst = self._instance(req, (f.walk, f.walk_seq, -1))
        if f.kind == K.FRAME_KIND_START_WALK:
            req.routes.update(f.routes)
            req.parked.append((inst, f.persisted_expected, tensors))
            self._unpark(req)
        elif f.kind == K.FRAME_KIND_DATA:
            value = next(iter(tensors.values()), None)
            self.router.accept(req, inst, f.node, f.edge, f.iteration, value, f.done)
            self._unpark(req)
        elif f.kind == K.FRAME_KIND_LOOP_END:
            lp = inst.plan.nodes[f.node].loop
            assert lp is not None, f"LOOP_END for node '{f.node}' outside a loop"
            inst.end_loop(lp.name, f.iteration)
            for node in inst.local:
                self.router.flush_loop_outputs(req, inst, node)
        self._advance(req, inst)

    def _instance(self, req: RequestCtx, key: InstanceKey) -> WalkInstance:
        inst = req.instances.get(key)
        if inst is None:
            walk = key[0]
            if walk not in self.model.plans:
                raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"node group '{self.group}': unknown walk '{walk}'")
            inst = req.instances[key] = self.router.new_instance(key)
        return inst

    def _unpark(self, req: RequestCtx) -> None:
        """Start walks whose persisted inputs have all arrived (they may trail START_WALK)."""
        if not req.parked:
            return
        waiting = []
        for inst, expected, given in req.parked:
            if req.persist_received < expected:
                waiting.append((inst, expected, given))
                continue
            self._start(req, inst, given)
            for other in list(req.instances.values()):  # chunk walks spawned before the start
                self._advance(req, other)
        req.parked = waiting

    def _start(self, req: RequestCtx, inst: WalkInstance, given: dict[str, torch.Tensor]) -> None:
        for node, name in self.router.inputs[inst.walk]:
            value = given.get(name)
            if value is None:
                value = req.persisted.get((node, name))
            if value is None:
                raise RequestFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"node group '{self.group}': walk '{inst.walk}' input '{name}' for node '{node}' "
                                    f"was neither given when the walk started nor persisted by an earlier walk")
            inst.put(node, name, -1, value)
        inst.started = True

    def _spawn_chunks(self, req: RequestCtx, parent: WalkInstance, dst_walk: str, edge: str, chunks) -> None:
        for info, tensor in chunks:
            key = (dst_walk, parent.key[1], info.index)
            child = req.instances[key] = self.router.new_instance(key)
            child.chunk, child.parent = info, parent.key
            parent.children += 1
            self._start(req, child, {edge: tensor})
            self._advance(req, child)

    # -- schedule ------------------------------------------------------------------------
    def _advance(self, req: RequestCtx, inst: WalkInstance) -> None:
        """Queue every node of the instance that can fire; report the fragment when done."""
        if req.kwargs is None:
            return  # START_WALK (with the request's kwargs) has not arrived yet
        for node in inst.local:
            nxt = inst.next_call(node)
            if nxt is not None:
                inst.busy.add(node)
                key = (inst.walk, node)
                q = self.ready.get(key)
                if q is None:
                    q = self.ready[key] = deque()
                    self._order.append(key)
                q.append(Pending(req.request_id, inst.key, nxt[0], nxt[1]))
                self._wake.set()
        if inst.finished() and req.instances.get(inst.key) is inst:
            del req.instances[inst.key]
            if inst.parent is not None:
                parent = req.instances[inst.parent]
                parent.children -= 1
                self._advance(req, parent)
            else:
                self.router.fragment_done(req, inst)

    def _next_batch(self, taken: set[tuple[str, str]]) -> tuple[tuple[str, str], list[Pending]] | None:
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

    async def run(self) -> None:
        """schedule -> execute -> update, forever, in rounds: one batch of every ready
        (walk, node), then arriving frames get in (after each round, or in a group without
        engines once ``round_budget_s`` has passed). Frames produced between two yields leave
        together (one message per link), not one message per node. Stateless nodes: one batch at a
        time. Engine nodes: ready calls go to the engine's inbox; each engine steps on its
        own worker thread, back to back, while this loop routes the previous step's outputs."""
        while True:
            try:
                await self._rounds()
            except Exception as e:  # last resort: the loop must outlive a bug, or every request here hangs
                self._failed_on_bug(list(self.requests), "the runtime loop", e)
                self.ready.clear()  # what was queued belongs to the failed requests
                self._order.clear()
                await asyncio.sleep(0.1)  # a fault that repeats does not spin

    async def _rounds(self) -> None:
        loop = asyncio.get_running_loop()
        clock = time.perf_counter
        yielded = clock()
        while True:
            picked, finished, taken = False, False, set()
            while (nxt := self._next_batch(taken)) is not None:
                picked = True
                (walk, node), batch = nxt
                calls, live = self._calls(walk, node, batch)
                if node in self.engines:
                    self._to_engine(node, calls, live)
                elif calls:
                    t0 = time.perf_counter()
                    outputs = await self._execute(loop, node, calls)
                    self._update(node, live, calls, outputs)
                    self.steps += 1
                    self.calls += len(calls)
                    self.metrics.step(node, len(calls), time.perf_counter() - t0)
                finished = self._pump_engines(loop) or finished
            if not picked:
                finished = self._pump_engines(loop)
                if not finished:
                    self._wake.clear()
                    if not self._engines_ready():
                        await self._wake.wait()
                    continue
            if clock() - yielded >= self.round_budget_s:
                await asyncio.sleep(0)  # let arriving frames in between rounds
                yielded = clock()

    def _to_engine(self, node: str, calls: list[NodeCall], live) -> None:
        """Calls the engine takes now (``try_submit``) skip the wait for its next step;
        outputs it has at once are routed at once."""
        engine = self.engines[node]
        now_live, now_calls, now_out = [], [], []
        for call, where in zip(calls, live, strict=True):
            self._in_engine[id(call)] = (call, *where, node)
            try:
                taken: bool | dict | Exception = engine.try_submit(call)
            except Exception as e:
                taken = e  # fails this call like a failed step would
            if taken is False:
                self._inbox[node].append(call)
            elif taken is not True:  # outputs (or the error) now
                del self._in_engine[id(call)]
                now_live.append(where)
                now_calls.append(call)
                now_out.append(taken)
        if now_calls:
            self.calls += len(now_calls)
            self._update(node, now_live, now_calls, now_out)

    def _engines_ready(self) -> bool:
        return any(f is not None and f.done() for f in self._engine_step.values())

    def _pump_engines(self, loop) -> bool:
        """Start the next step of every engine whose step finished, then route the finished
        step's outputs while the next one runs; True if any finished. (The calls those
        outputs produce join the step after: an engine never idles while this loop routes.)"""
        finished = False
        for node, engine in self.engines.items():
            fut = self._engine_step[node]
            if fut is not None:
                if not fut.done():
                    continue
                self._engine_step[node] = None
                finished = True
            self._launch_engine(loop, node, engine)
            if fut is not None:
                self._engine_done(node, fut)
        return finished

    def _launch_engine(self, loop, node: str, engine: EngineNode) -> None:
        inbox, releases = self._inbox[node], self._engine_releases[node]
        live = [c for c in inbox if c.request_id in self.requests]
        if live or releases or engine.has_work:
            self._inbox[node], self._engine_releases[node] = [], []
            t0 = time.perf_counter()
            args = (engine, live, releases, t0)
            if engine.blocking:
                fut = loop.run_in_executor(self._engine_executor, _engine_call, *args)
            else:
                fut = loop.create_future()
                try:
                    fut.set_result(_engine_call(*args))
                except Exception as e:
                    fut.set_exception(e)
            fut.add_done_callback(lambda _f: self._wake.set())
            self._engine_step[node] = fut

    def _engine_done(self, node: str, fut) -> None:
        try:
            done, t0 = fut.result()
        except Exception as e:
            log.exception("engine of node '%s' failed a step", node)
            done, t0 = [(c, e) for c, _r, _i, n in self._in_engine.values() if n == node], time.perf_counter()
        live, calls, outputs = [], [], []
        for call, out in done:
            entry = self._in_engine.pop(id(call), None)
            if entry is None:
                continue  # released meanwhile
            calls.append(call)
            live.append((entry[1], entry[2]))
            outputs.append(out)
        self.steps += 1
        self.calls += len(calls)
        self._update(node, live, calls, outputs)
        self.metrics.step(node, len(calls), time.perf_counter() - t0)

    # -- execute -------------------------------------------------------------------------
    def _calls(self, walk: str, node: str, batch: list[Pending]):
        calls, live = [], []
        for p in batch:
            req = self.requests.get(p.request_id)
            inst = req.instances.get(p.key) if req else None
            if inst is None:
                continue  # released while queued
            calls.append(NodeCall(p.request_id, walk, p.iteration, p.inputs, req.kwargs or {},
                                  req.node_state.setdefault(node, {}), inst.chunk))
            live.append((req, inst))
        return calls, live

    async def _execute(self, loop, node: str, calls: list[NodeCall]) -> list:
        sub = self.submodules[node]

        def forward(batch_calls):
            return sub.forward(sub.prepare_inputs(batch_calls))

        async def run(batch_calls):
            if sub.is_blocking(batch_calls):
                return await loop.run_in_executor(self._executor, forward, batch_calls)
            return forward(batch_calls)

        try:
            return await run(calls)
        except Exception as e:
            if len(calls) == 1:
                return [e]
        results = []  # isolate the failing request(s): one call at a time
        for c in calls:
            try:
                results.append((await run([c]))[0])
            except Exception as e:
                results.append(e)
        return results

    # -- update --------------------------------------------------------------------------
    def _update(self, node: str, live, calls: list[NodeCall], outputs: list) -> None:
        sub = self.submodules[node]
        for (req, inst), call, out in zip(live, calls, outputs, strict=True):
            if req.request_id not in self.requests:
                continue
            inst.busy.discard(node)
            if isinstance(out, Exception):
                self._failed_on_bug([req.request_id], f"node '{node}'", out)
                continue
            try:
                self.router.after_fire(req, inst, node, call, out, sub)
                self._advance(req, inst)
            except RequestFailed as e:
                self.fail(req.request_id, e.code, e.message)
            except Exception as e:  # a bug in routing or in the model's check_stop: this request only
                self._failed_on_bug([req.request_id], f"routing the outputs of node '{node}'", e)

    # -- endings -------------------------------------------------------------------------
    def _failed_on_bug(self, request_ids: list[str], what: str, e: BaseException) -> None:
        """``what`` raised ``e`` (a bug, ours or the model's): log it, fail those requests with
        INTERNAL "node group '<group>': <what> failed: <error>"."""
        log.error("node group '%s': %s failed (requests %s)", self.group, what, request_ids, exc_info=e)
        for rid in request_ids:
            self.fail(rid, grpc.StatusCode.INTERNAL, f"node group '{self.group}': {what} failed: {type(e).__name__}: {e}")

    def fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        if request_id in self.requests:
            self.links["conductor"].send(pb.Frame(kind=K.FRAME_KIND_FAIL, request_id=request_id,
                                                  error=pb.FrameError(code=code.value[0], message=message)))
        self.release(request_id)

    def release(self, request_id: str) -> None:
        self.released[request_id] = None
        if len(self.released) > MAX_TOMBSTONES:
            self.released.popitem(last=False)
        if self.requests.pop(request_id, None) is not None:
            for node, sub in self.submodules.items():
                if node in self.engines:
                    self._engine_releases[node].append(request_id)
                    self._wake.set()
                else:
                    sub.release(request_id)
            for key in [k for k, (c, *_) in self._in_engine.items() if c.request_id == request_id]:
                del self._in_engine[key]
        self.links.forget(request_id)

    def _on_link_down(self, link, reason: str, request_ids: set[str]) -> None:
        if link.peer == "conductor":
            for rid in list(self.requests):
                self.release(rid)
            return
        for rid in request_ids:
            self.fail(rid, grpc.StatusCode.UNAVAILABLE, f"node group '{self.group}': peer node group {reason}")

    @property
    def pending_requests(self) -> int:
        return len(self.requests)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for engine in self.engines.values():  # on the engine's thread: after its last step
            try:
                await loop.run_in_executor(self._engine_executor, engine.close)
            except Exception:
                log.exception("closing an engine failed")
        await self.links.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._engine_executor.shutdown(wait=False, cancel_futures=True)


def _engine_call(engine: EngineNode, calls: list[NodeCall], releases: list[str], t0: float):
    """One engine step on the engine's thread: apply releases, then submits, then step."""
    for rid in releases:
        engine.release(rid)
    for call in calls:
        engine.submit(call)
    return (engine.step() if engine.has_work else []), t0
