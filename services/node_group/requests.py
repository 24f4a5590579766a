"""What a node group holds per request, and the effects its router asks the runtime to apply.

The router (router.py) reads and writes this state and never touches a link: it appends
``Send`` effects (frames for a peer group or the conductor), ``Advance`` effects (a walk
instance that may have nodes ready) and ``Handed`` effects (a value handed over locally, for
the edge metrics) to a list the runtime applies in order.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import final

import grpc
import torch

from mstar.models.base import ChunkInfo
from mstar.services.node_group.fragment import InstanceKey, WalkInstance
from mstar.v1 import node_group_pb2 as pb

#: ``Send.target`` of frames for the conductor (emits, fragment ends, failures)
CONDUCTOR = "conductor"
#: request ids remembered after release, so late frames of an ended request are dropped
MAX_TOMBSTONES = 100_000
#: requests known only from peers' frames, not yet started by the conductor (a persisted value may
#: arrive long before its START_WALK: a think-mode decode can run between): at most this many, each
#: for at most UNSTARTED_TTL_S (beyond the conductor's default request timeout), so frames with
#: made-up request ids cannot pile up state; the conductor's RELEASE frees the real ones sooner
MAX_UNSTARTED, UNSTARTED_TTL_S = 4096, 900.0
log = logging.getLogger(__name__)


class RequestFailed(Exception):
    """Ends one request with ``code``; raised by the router, caught by the runtime."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class RequestCtx:
    request_id: str
    kwargs: dict | None = None  # the request's validated model kwargs; None until START_WALK brings them
    persisted: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # (node, input) -> value
    node_state: dict[str, dict] = field(default_factory=dict)  # each node's scratch space for the request
    instances: dict[InstanceKey, WalkInstance] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)  # group -> replica address this request is pinned to
    persist_received: int = 0  # persisted values stored, local and remote
    persist_sent: dict[str, int] = field(default_factory=dict)  # since the last FRAGMENT_DONE, by group
    parked: list[tuple[WalkInstance, int, dict]] = field(default_factory=list)  # starts waiting for persisted values


@dataclass(slots=True)
class Pending:
    """A node call that is ready: queued until the scheduler batches it."""

    request_id: str
    key: InstanceKey
    iteration: int
    inputs: dict[str, torch.Tensor]
    chunk: ChunkInfo | None  # the stream chunk the call takes (a stream into a running loop)


@final  # the runtime applies an effect by its exact type
@dataclass(slots=True)
class Send:
    """A frame for ``target`` (a node group of the request's routes, or CONDUCTOR)."""

    target: str
    frame: pb.Frame
    tensors: list[tuple[str, torch.Tensor]]


@final  # the runtime applies an effect by its exact type
@dataclass(slots=True)
class Advance:
    """``inst`` got values (or was started): queue what can fire, report it if finished."""

    inst: WalkInstance


@final  # the runtime applies an effect by its exact type
@dataclass(slots=True)
class Handed:
    """A value of edge ``edge`` handed over inside this group (colocated: the tensor itself):
    the runtime counts it as the edge's local traffic."""

    edge: str
    nbytes: int


Effect = Send | Advance | Handed


class Requests(dict[str, RequestCtx]):
    """The requests a node group holds, by id, and the ids it released (``released``)."""

    def __init__(self, group: str):
        super().__init__()
        self.group = group
        self.released: OrderedDict[str, None] = OrderedDict()
        self._unstarted: OrderedDict[str, float] = OrderedDict()  # request -> when its first frame came
        self.dropped = 0  # unstarted requests dropped (made-up ids, or walks that never started)

    def open(self, rid: str, starts: bool) -> RequestCtx:
        """The request of a frame, made at its first. ``starts``: the frame is the conductor's START_WALK;
        a request first seen in a peer's frame counts as unstarted until then (see ``overdue``)."""
        req = self.get(rid)
        if req is None:
            req = self[rid] = RequestCtx(rid)
            if not starts:
                self._unstarted[rid] = time.monotonic()
        elif starts:
            self._unstarted.pop(rid, None)
        return req

    def overdue(self) -> list[str]:
        """Unstarted requests past the bounds: the caller releases them."""
        if not self._unstarted:
            return []
        now, out = time.monotonic(), []
        while self._unstarted and (len(self._unstarted) > MAX_UNSTARTED
                                   or next(iter(self._unstarted.values())) < now - UNSTARTED_TTL_S):
            out.append(self._unstarted.popitem(last=False)[0])
        if out:
            self.dropped += len(out)
            log.warning("node group '%s': dropped %d request(s) whose walks never started (%d so far): frames "
                        "came for ids the conductor did not start", self.group, len(out), self.dropped)
        return out

    def close(self, rid: str) -> RequestCtx | None:
        """Forget the request (tombstoned); its state, or None if it held none."""
        self._unstarted.pop(rid, None)
        self.released[rid] = None
        if len(self.released) > MAX_TOMBSTONES:
            self.released.popitem(last=False)
        return self.pop(rid, None)
