from __future__ import annotations

import enum

import torch

from mstar import wire
from mstar.v1 import tensor_pb2 as pb


class Protocol(enum.Enum):
    TCP = "TCP"
    SHM = "SHM"
    RDMA = "RDMA"


def parse_protocol(value: str) -> Protocol:
    try:
        proto = Protocol(value.upper())
    except ValueError:
        raise ValueError(f"--tensor-comm-protocol must be one of SHM, TCP, RDMA; got '{value}'") from None
    if proto is Protocol.RDMA:
        raise ValueError("--tensor-comm-protocol RDMA needs the Mooncake transport, which this build does not include yet; use SHM (same host) or TCP")
    return proto


class TensorSender:
    """Encodes tensors for one outgoing link."""

    def encode_into(self, msg: pb.Tensor, name: str, t: torch.Tensor) -> None:
        """Write ``t`` into ``msg`` (a new element of a frame's tensors)."""
        wire.fill_proto(msg, name, t)

    def release(self, buffer_ids) -> None:
        """The receiver acknowledged these buffers."""

    def close(self) -> None:
        """The link ended: free every buffer, acknowledged or not."""


class TensorReceiver:
    """Decodes tensors arriving on one incoming link."""

    def __init__(self) -> None:
        from mstar.services.transport.shm import ShmReader

        self._shm = ShmReader()

    def decode(self, msg: pb.Tensor, acks: list[int]) -> torch.Tensor:
        if msg.WhichOneof("payload") == "shm":
            return self._shm.read(msg, acks)
        return wire.from_proto(msg)

    def close(self) -> None:
        self._shm.close()


def make_sender(protocol: Protocol, owner: str) -> TensorSender:
    if protocol is Protocol.SHM:
        from mstar.services.transport.shm import ShmSender

        return ShmSender(owner)
    return TensorSender()
