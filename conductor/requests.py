"""Request lifecycle in the conductor: seed walks, follow fragments, run the model's
state machine at each walk end, finish, fail or cancel — and always release."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import grpc
import torch

from mstar import tls as mtls
from mstar.conductor.replicas import NoReplica, Replicas
from mstar.config import Placement
from mstar.models.base import Emit, Model, Output, RequestState, WalkSeed
from mstar.models.graph import INPUT
from mstar.services.links import Links
from mstar.services.transport import Protocol
from mstar.v1 import node_group_pb2 as pb

log = logging.getLogger(__name__)
K = SimpleNamespace(**dict(pb.FrameKind.items()))  # plain ints: the enum wrapper's attribute lookup costs ~3 us


@dataclass
class Failure:
    code: grpc.StatusCode
    message: str


@dataclass
class Finished:
    pass


Event = Output | Failure | Finished


@dataclass
class ActiveRequest:
    request_id: str
    state: RequestState
    kwargs_json: str
    t0: float
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    seq: itertools.count = field(default_factory=itertools.count)
    pending: dict[int, tuple[str, set[str]]] = field(default_factory=dict)  # walk_seq -> (walk, groups left)
    routes: dict[str, str] = field(default_factory=dict)  # group -> pinned replica address
    touched: set[str] = field(default_factory=set)  # groups sent to (their pinned replicas hold state)
    persisted_to: dict[str, int] = field(default_factory=dict)  # persisted values sent to each group
    walks_run: int = 0
    first_output_s: float = 0.0
    audio_seconds: float = 0.0
    ended: bool = False


class RequestTable:
    """All in-flight requests and their links to the node groups."""

    def __init__(self, model: Model, placement: Placement, replicas: Replicas, protocol: Protocol,
                 tls: mtls.TLSSettings | None = None):
        self.model, self.placement, self.replicas = model, placement, replicas
        self.links = Links("conductor", protocol, self._on_link_down, tls=tls)
        self.active: dict[str, ActiveRequest] = {}
        self._inputs_of: dict[tuple[str, str], set[str]] = {}  # (walk, group) -> input names read there
        for walk, plan in model.plans.items():
            for e in plan.walk.edges:
                if e.src == INPUT:
                    self._inputs_of.setdefault((walk, placement.host(walk, e.dst)), set()).add(e.name)

    # -- walks ---------------------------------------------------------------------------
    def pin(self, ar: ActiveRequest) -> None:
        """Choose the replica of every node group this request will use (NoReplica if a
        group has none healthy)."""
        try:
            for g in self.placement.config.group_names:
                ar.routes[g] = self.replicas.pick(g)
        except NoReplica:
            self.unpin(ar)
            raise

    def unpin(self, ar: ActiveRequest) -> None:
        for g, address in ar.routes.items():
            self.replicas.unpin(g, address)
        ar.routes = {}

    def start_walk(self, ar: ActiveRequest, seed: WalkSeed) -> None:
        plan = self.model.plans.get(seed.walk)
        if plan is None:
            raise RuntimeError(f"the state machine chose unknown walk '{seed.walk}'")
        unread = set(seed.inputs) - plan.input_names
        if unread:
            raise RuntimeError(f"the state machine gave walk '{seed.walk}' inputs it does not read: {sorted(unread)}")
        seq = next(ar.seq)
        groups = self.placement.fragments(seed.walk)
        ar.pending[seq] = (seed.walk, set(groups))
        ar.walks_run += 1
        for g in groups:
            names = self._inputs_of.get((seed.walk, g), set())
            frame = pb.Frame(kind=K.FRAME_KIND_START_WALK, request_id=ar.request_id, walk=seed.walk, walk_seq=seq,
                             iteration=-1, chunk_index=-1, parent_walk_seq=-1, request_kwargs_json=ar.kwargs_json,
                             persisted_expected=ar.persisted_to.get(g, 0), routes=ar.routes)
            ar.touched.add(g)
            self.links.to(g, ar.routes[g]).send(frame, [(n, t) for n, t in seed.inputs.items() if n in names])

    def on_batch(self, batch: pb.FrameBatch, decoded: list) -> None:
        """Frames of one batch with their tensors (``TensorReceiver.decode_batch``)."""
        for f, tensors in zip(batch.frames, decoded, strict=True):
            ar = self.active.get(f.request_id)
            if isinstance(tensors, Exception):  # a transport failure ends this request, not the stream
                if ar is not None:
                    self.fail(ar, grpc.StatusCode.INTERNAL, f"conductor: cannot decode a tensor sent by '{batch.sender}': "
                              f"{type(tensors).__name__}: {tensors}")
                continue
            if ar is None or ar.ended:
                continue  # a request that already ended: late frames are dropped
            try:
                self._on_frame(ar, f, batch.sender, tensors)
            except Exception as e:  # a model bug must end the request, not the conductor
                self.model_failed(ar, e)

    def _on_frame(self, ar: ActiveRequest, f: pb.Frame, sender: str, tensors: list[torch.Tensor]) -> None:
        if f.kind == K.FRAME_KIND_EMIT:
            emit = Emit(f.edge, f.walk, f.node, f.iteration, f.chunk_index, tensors[0])
            for out in self.model.postprocess(ar.state, emit):
                if not ar.first_output_s:
                    ar.first_output_s = time.perf_counter() - ar.t0
                ar.audio_seconds += out.audio_seconds
                ar.events.put_nowait(out)
        elif f.kind == K.FRAME_KIND_FRAGMENT_DONE:
            for g, n in f.persisted_sent.items():
                ar.persisted_to[g] = ar.persisted_to.get(g, 0) + n
                if n:
                    ar.touched.add(g)  # it holds the values: it gets the RELEASE, even with no walk started there
            walk, left = ar.pending.get(f.walk_seq, ("", set()))
            left.discard(sender)
            if walk and not left:
                del ar.pending[f.walk_seq]
                ar.state.walks_done.append(walk)
                seed = self.model.next_walk(ar.state, walk)
                if seed is not None:
                    self.start_walk(ar, seed)
                elif not ar.pending:
                    self.end(ar, Finished())
        elif f.kind == K.FRAME_KIND_FAIL:
            self.fail(ar, grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == f.error.code)), f.error.message)

    # -- endings -------------------------------------------------------------------------
    def model_bug(self, e: BaseException) -> str:
        """The INTERNAL message of a request the model's conductor-side code failed."""
        return f"model '{self.model.name}' failed in the conductor: {type(e).__name__}: {e}"

    def model_failed(self, ar: ActiveRequest, e: BaseException) -> None:
        log.error("request %s: conductor-side model code failed", ar.request_id, exc_info=e)
        self.fail(ar, grpc.StatusCode.INTERNAL, self.model_bug(e))

    def fail(self, ar: ActiveRequest, code: grpc.StatusCode, message: str) -> None:
        self.end(ar, Failure(code, message))

    def end(self, ar: ActiveRequest, event: Event) -> None:
        if ar.ended:
            return
        ar.ended = True
        ar.events.put_nowait(event)
        self.release(ar, now=not isinstance(event, Finished))

    def release(self, ar: ActiveRequest, now: bool = True) -> None:
        """Tell every node group the request touched to free what it holds. A request that
        failed or was cancelled may still be computing there: its RELEASE leaves at once. One
        that finished holds only idle state: its RELEASE rides with the link's next message
        (``Link.send_later``, at most a few ms later), which under load saves a message a group.
        A request that ended early may have had values sent peer to peer that no fragment reported
        yet: every serving replica it is pinned to then gets the RELEASE."""
        ar.ended = True
        groups = ar.touched | {g for g, a in ar.routes.items() if a in self.replicas.serving(g)} if now else ar.touched
        for g in groups:
            link = self.links.to(g, ar.routes[g])
            frame = pb.Frame(kind=K.FRAME_KIND_RELEASE, request_id=ar.request_id)
            link.send(frame) if now else link.send_later(frame)
            link.forget(ar.request_id)
        ar.touched.clear()
        self.unpin(ar)

    def _on_link_down(self, link, reason: str, request_ids: set[str]) -> None:
        self.replicas.mark_down(link.peer, link.address, f"stream broke: {reason}")
        for ar in list(self.active.values()):
            if ar.routes.get(link.peer) == link.address and (link.peer in ar.touched or ar.request_id in request_ids):
                ar.touched.discard(link.peer)
                self.fail(ar, grpc.StatusCode.UNAVAILABLE, f"node group {reason}")

    def connect(self, group: str, address: str) -> None:
        """Open the stream to a replica now, so a dead one is noticed at once."""
        self.links.to(group, address).send(pb.Frame(kind=K.FRAME_KIND_UNSPECIFIED))

    def connect_all(self) -> None:
        for group, reps in self.replicas.groups.items():
            for address in reps:
                self.connect(group, address)
