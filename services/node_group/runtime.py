"""The node-group runtime: frames in, ready nodes batched and executed, effects applied.

Its loop reads like the design: schedule (``Schedule.next_calls``) -> execute (a stateless
node's forward, or an engine node's ``EngineDriver``) -> update (``Router.after_fire``
returns effects: frames to send, instances to advance, local hand-overs to count; ``_apply``
carries them out). Where a frame goes is ``Routes``' (routes.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from types import SimpleNamespace

import grpc
import torch

from mstar import metrics
from mstar import tls as mtls
from mstar.config import Placement
from mstar.env import settings
from mstar.models.base import Model
from mstar.services.engines.tensor_parallel import TPSpec
from mstar.services.node_group.engine_driver import Ready
from mstar.services.node_group.nodes import Nodes
from mstar.services.node_group.requests import (
    CONDUCTOR,
    Advance,
    Effect,
    Handed,
    RequestCtx,
    RequestFailed,
    Requests,
    Send,
)
from mstar.services.node_group.router import Router
from mstar.services.node_group.routes import Routes
from mstar.services.node_group.schedule import Schedule
from mstar.services.transport import Protocol
from mstar.services.transport.location import local_location
from mstar.v1 import node_group_pb2 as pb

log = logging.getLogger(__name__)
K = SimpleNamespace(**dict(pb.FrameKind.items()))  # plain ints: the enum wrapper's attribute lookup costs ~3 us


class NodeGroupRuntime:
    def __init__(self, group: str, model: Model, placement: Placement, peers: dict[str, str | list[str]],
                 conductor: str, protocol: Protocol, device: str = "cpu", cache_dir: str | None = None,
                 tp: TPSpec | None = None, tls: mtls.TLSSettings | None = None):
        """``tp``: rank 0's place in the group's tensor-parallel ranks (tp_size > 1). ``tls``: the
        mesh's mutual TLS for every link. ``conductor``: its internal (WalkEvents) address."""
        self.group, self.model, self.placement = group, model, placement
        self.router = Router(group, model, placement)
        self._wake = asyncio.Event()
        self.nodes = Nodes(model, placement, group, device, cache_dir, tp, self.router.local, self._wake.set)
        self.submodules, self.engines, self.drivers = self.nodes.submodules, self.nodes.engines, self.nodes.drivers
        self.location = local_location(group, device)
        self.tls = tls
        self.routes = Routes(group, placement, peers, conductor, protocol, self._on_link_down, tls)
        self.links = self.routes.links
        self.schedule = Schedule(self.router, self.submodules)
        self.requests = Requests(group)
        self.released = self.requests.released
        #: back-to-back rounds before arriving frames get in (docs/serving.md, "Round budget"); groups with
        #: engines yield every round: a finished engine step is seen only when the loop runs
        self.round_budget_s = 0.0 if self.engines else settings().round_budget_s
        self.steps = 0  # batches executed
        self.calls = 0  # node calls executed (calls / steps = mean batch size)
        self.metrics = metrics.GroupMetrics(group, lambda: len(self.schedule), lambda: len(self.requests))
        self.local_edges = metrics.EdgeMetrics(group, group)  # values handed over here (``Handed``)

    # -- frames in ---------------------------------------------------------------------------
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
        if f.kind == K.FRAME_KIND_STREAM_TAKEN:  # for a producer's instance; none if it finished meanwhile
            req = self.requests.get(f.request_id)
            if req is not None and (inst := req.instances.get((f.walk, f.walk_seq, -1))) is not None:
                self.router.stream_taken(req, inst, f.node, f.edge, f.iteration, f.done)
                self._apply(req, [Advance(inst)])
            return
        req = self.requests.open(f.request_id, f.kind == K.FRAME_KIND_START_WALK)
        for rid in self.requests.overdue():
            self.release(rid)
        if f.request_kwargs_json and req.kwargs is None:
            req.kwargs = json.loads(f.request_kwargs_json)
        inst = self.router.instance(req, (f.walk, f.walk_seq, -1))
        out: list[Effect] = []
        if f.kind == K.FRAME_KIND_START_WALK:
            req.routes.update(f.routes)
            self.router.start_walk(req, inst, f.persisted_expected, tensors, out)
        elif f.kind == K.FRAME_KIND_DATA:
            self.router.accept(req, inst, f.node, f.edge, f.iteration, next(iter(tensors.values()), None), f.done, out)
            self.router.unpark(req, out)
        elif f.kind == K.FRAME_KIND_LOOP_END:
            self.router.loop_end(req, inst, f.node, f.iteration, out)
        out.append(Advance(inst))
        self._apply(req, out)

    def _apply(self, req: RequestCtx, out: list[Effect]) -> None:
        """Carry out the router's effects in order (advancing may add more: they run too)."""
        for effect in out:
            if type(effect) is Send:
                self.routes.send(req.routes, effect)
            elif type(effect) is Handed:
                self.local_edges.sent(effect.edge, "local", effect.nbytes, 0.0)
            elif self.schedule.advance(req, effect.inst, out):
                self._wake.set()

    # -- the loop: schedule -> execute -> update ---------------------------------------------
    async def run(self) -> None:
        """Rounds forever: one batch of every ready (walk, node), engines polled after each;
        arriving frames get in between rounds. Frames produced between two yields leave
        together (one message per link)."""
        while True:
            try:
                await self._rounds()
            except Exception as e:  # last resort: the loop must outlive a bug, or every request here hangs
                self._failed_on_bug(list(self.requests), "the runtime loop", e)
                self.schedule.clear()  # what was queued belongs to the failed requests
                await asyncio.sleep(0.1)  # a fault that repeats does not spin

    async def _rounds(self) -> None:
        loop = asyncio.get_running_loop()
        clock = time.perf_counter
        yielded = clock()
        while True:
            ran = False
            taken: set[tuple[str, str]] = set()  # (walk, node) batched this round
            while (nxt := self.schedule.next_calls(taken, self.requests)) is not None:
                ran = True
                walk, node, calls, where = nxt
                driver = self.drivers.get(node)
                if driver is not None:
                    ready = [(c, w, r.outputs) for c, w in zip(calls, where, strict=True)
                             if type(r := driver.submit(c, w)) is Ready]
                    self._completed(node, ready)
                elif calls:
                    t0 = clock()
                    outputs = await self.nodes.execute(loop, walk, node, calls)
                    self._completed(node, list(zip(calls, where, outputs, strict=True)), (walk, node) in self.nodes.whole_loops)
                    self.steps += 1
                    self.metrics.step(node, len(calls), clock() - t0)
                ran = self._poll_engines(loop) or ran
            ran = self._poll_engines(loop) or ran
            if not ran:
                self._wake.clear()
                if not any(d.step_done for d in self.drivers.values()):
                    await self._wake.wait()
                continue
            if clock() - yielded >= self.round_budget_s:
                await asyncio.sleep(0)  # let arriving frames in between rounds
                yielded = clock()

    def _poll_engines(self, loop) -> bool:
        """Launch each engine's next step once its last finished, then route that step's
        outputs while the next one runs; True if any step finished."""
        finished = False
        for node, driver in self.drivers.items():
            done = driver.poll(loop)
            if done is None:
                continue
            finished = True
            self.steps += 1
            self._completed(node, done)
            self.metrics.step(node, len(done), driver.last_step_s)
        return finished

    def _completed(self, node: str, done: list, whole: bool = False) -> None:
        """Route each finished call's outputs: (call, (req, inst), outputs or the error);
        ``whole``: each call ran the node's whole loop."""
        sub = self.submodules[node]
        self.calls += len(done)
        for call, (req, inst), outputs in done:
            if req.request_id not in self.requests:
                continue
            if isinstance(outputs, Exception):
                self._failed_on_bug([req.request_id], f"node '{node}'", outputs)
                continue
            out: list[Effect] = []
            try:
                if whole:
                    self.router.after_loop(req, inst, node, outputs, out)
                else:  # the loop's stop, where this call decides it, is the model's answer
                    stop = bool(sub.check_stop(call, outputs)) if self.router.fired(inst, node, call, outputs) else None
                    self.router.after_fire(req, inst, node, call, outputs, stop, out)
                out.append(Advance(inst))
                self._apply(req, out)
            except RequestFailed as e:
                self.fail(req.request_id, e.code, e.message)
            except Exception as e:  # a bug in routing or in the model's check_stop: this request only
                self._failed_on_bug([req.request_id], f"routing the outputs of node '{node}'", e)

    # -- endings -----------------------------------------------------------------------------
    def _failed_on_bug(self, request_ids: list[str], what: str, e: BaseException) -> None:
        """``what`` raised ``e`` (a bug, ours or the model's): log it, fail those requests with
        INTERNAL "node group '<group>': <what> failed: <error>"."""
        log.error("node group '%s': %s failed (requests %s)", self.group, what, request_ids, exc_info=e)
        for rid in request_ids:
            self.fail(rid, grpc.StatusCode.INTERNAL, f"node group '{self.group}': {what} failed: {type(e).__name__}: {e}")

    def fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        if request_id in self.requests:
            self.links[CONDUCTOR].send(pb.Frame(kind=K.FRAME_KIND_FAIL, request_id=request_id,
                                                error=pb.FrameError(code=code.value[0], message=message)))
        self.release(request_id)

    def release(self, request_id: str) -> None:
        if self.requests.close(request_id) is not None:
            self.nodes.release(request_id)
        self.links.forget(request_id)

    def _on_link_down(self, link, reason: str, request_ids: set[str]) -> None:
        if link.peer == CONDUCTOR:
            for rid in list(self.requests):
                self.release(rid)
            return
        for rid in request_ids:
            self.fail(rid, grpc.StatusCode.UNAVAILABLE, f"node group '{self.group}': peer node group {reason}")

    async def close(self) -> None:
        await self.nodes.close()
        await self.routes.close()
