"""What a node group holds per request, and the effects its router asks the runtime to apply.

The router (router.py) reads and writes this state and never touches a link: it appends
``Send`` effects (frames for a peer group or the conductor) and ``Advance`` effects (a walk
instance that may have nodes ready) to a list the runtime applies in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import torch

from mstar.models.base import ChunkInfo
from mstar.services.node_group.fragment import InstanceKey, WalkInstance
from mstar.v1 import node_group_pb2 as pb

#: ``Send.target`` of frames for the conductor (emits, fragment ends, failures)
CONDUCTOR = "conductor"


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


@dataclass(slots=True)
class Send:
    """A frame for ``target`` (a node group of the request's routes, or CONDUCTOR)."""

    target: str
    frame: pb.Frame
    tensors: list[tuple[str, torch.Tensor]]


@dataclass(slots=True)
class Advance:
    """``inst`` got values (or was started): queue what can fire, report it if finished."""

    inst: WalkInstance


Effect = Send | Advance
