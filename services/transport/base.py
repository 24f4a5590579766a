"""Transport selection and the per-link sender / per-stream receiver.

A link's sender learns where its peer runs from the first Ack on the stream (a
``Location``) and then picks, per tensor, the fastest transport that works between the
two services:

- same process: hand the tensor object over (``local``);
- same host: CUDA IPC for GPU tensors of ``CUDA_IPC_MIN_BYTES`` and more when the peer
  has a GPU, host shared memory otherwise (``cuda_ipc`` / ``shm``);
- other host: Mooncake (RDMA where devices exist, TCP otherwise) when both ends have
  it and the tensor is at least ``MOONCAKE_MIN_BYTES``, inline bytes otherwise
  (``mooncake`` / ``inline``).

Tensors under ``MIN_REF_BYTES`` travel inline unless the peer shares the process (a
reference costs more than the copy). Until the peer's location is known, tensors travel
inline. ``--tensor-comm-protocol`` can force one transport instead of AUTO.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import logging

import torch

from mstar import wire
from mstar.services.transport.location import PROCESS_TOKEN, host_id
from mstar.v1 import node_group_pb2
from mstar.v1 import tensor_pb2 as pb

log = logging.getLogger(__name__)

MIN_REF_BYTES = 64 * 1024
#: across hosts AUTO uses Mooncake from this size up: below it, inline bytes were faster in
#: bench/results/transport/netns.json (Mooncake TCP 0.39x inline at 1 MiB, 1.34x at 4 MiB, 2.5x at 16 MiB)
MOONCAKE_MIN_BYTES = 4 << 20
#: GPU tensors to a same-host GPU peer go by CUDA IPC from this size up: below it the host
#: round trip was as fast or faster (bench/results/transport/cuda_ipc.json: 0.7x at 64 KiB,
#: 1.1x at 1 MiB, 2.2x at 4 MiB on an H100)
CUDA_IPC_MIN_BYTES = 1 << 20
_ID_SHIFT = 48  # buffer ids carry their transport in the top bits
_KINDS = ("shm", "mooncake", "cuda_ipc", "local")


def pool_id(buffer_id: int) -> int:
    """A buffer id as its transport issued it (without the transport bits LinkSender adds)."""
    return buffer_id & ((1 << _ID_SHIFT) - 1)


PROTOCOL_HELP = ("AUTO (default: per edge, from where the peers run), TCP (inline bytes), SHM (same host) or "
                 "RDMA (Mooncake: RDMA where devices exist, else TCP)")


class Protocol(enum.Enum):
    AUTO = "AUTO"  # pick per edge from where the two services are
    TCP = "TCP"  # inline bytes in the gRPC frame
    SHM = "SHM"  # host shared memory (same host only)
    RDMA = "RDMA"  # Mooncake: RDMA where devices exist, TCP otherwise


_ALIASES = {"INLINE": "TCP", "MOONCAKE": "RDMA"}


def parse_protocol(value: str) -> Protocol:
    v = value.upper()
    try:
        proto = Protocol(_ALIASES.get(v, v))
    except ValueError:
        raise ValueError(f"--tensor-comm-protocol must be one of AUTO, TCP (inline), SHM, RDMA (Mooncake); got '{value}'") from None
    if proto is Protocol.RDMA:
        from mstar.services.transport import mooncake

        if not mooncake.available():
            raise ValueError(f"--tensor-comm-protocol {value} needs the Mooncake transfer engine: {mooncake.unavailable_reason()}")
    return proto


class TransportUnavailable(ValueError):
    """The forced ``--tensor-comm-protocol`` cannot work in this service; the message says why."""


def configure_service(address: str, protocol: Protocol) -> None:
    """At service start, before serving (and before the service's location is advertised).

    AUTO: offer Mooncake to peers on other hosts when this service can be reached from them (it
    binds a non-loopback address) and Mooncake is installed; loopback-only services never need
    it and start no engine. RDMA: every tensor of ``MIN_REF_BYTES`` or more, to any peer, is a
    Mooncake ref, so this service starts its engine now, on the address it binds (loopback
    included), and offers it to every sender; where the engine cannot start, this raises
    ``TransportUnavailable`` and the service must not serve (a sender's refs would fail each
    request that carries one)."""
    from mstar.services.transport import mooncake

    host = address.rsplit(":", 1)[0].strip("[]")
    if protocol is Protocol.RDMA:
        if not mooncake.available():
            raise TransportUnavailable(f"--tensor-comm-protocol RDMA needs the Mooncake transfer engine: "
                                       f"{mooncake.unavailable_reason()}")
        try:
            mooncake.configure(host)
            mooncake.engine()
        except mooncake.MooncakeError as e:
            raise TransportUnavailable(f"--tensor-comm-protocol RDMA: {e}") from None
    elif protocol is Protocol.AUTO and mooncake.available() and not host.startswith("127.") \
            and host not in ("localhost", "::1"):
        mooncake.configure(host)


def start_transport(address: str, value: str, who: str) -> Protocol:
    """A service's ``--tensor-comm-protocol``, parsed and set up (``configure_service``); one it
    cannot use is one ERROR line naming ``who`` and why, and exit code 2: it must not serve."""
    try:
        protocol = parse_protocol(value)
        configure_service(address, protocol)
    except ValueError as e:
        log.error("%s: %s", who, e)
        raise SystemExit(2) from None
    return protocol


class TensorSender:
    """Inline encoding, and the interface of the pooled transports."""

    def encode_into(self, msg: pb.Tensor, name: str, t: torch.Tensor) -> None:
        """Write ``t`` into ``msg`` (a new element of a frame's tensors)."""
        wire.fill_proto(msg, name, t)

    def release(self, buffer_ids) -> None:
        """The receiver acknowledged these buffers."""

    def close(self) -> None:
        """The link ended: free every buffer, acknowledged or not."""


#: transport -> (module, sender class, reader class); imported on first use
_TRANSPORTS = {
    "shm": ("shm", "ShmSender", "ShmReader"),
    "mooncake": ("mooncake", "MooncakeSender", "MooncakeReader"),
    "cuda_ipc": ("cuda_ipc", "CudaIpcSender", "CudaIpcReader"),
    "local": ("local", "LocalSender", "LocalReader"),
}


def _transport_class(kind: str, role: int):
    module, *classes = _TRANSPORTS[kind]
    return getattr(importlib.import_module(f"mstar.services.transport.{module}"), classes[role])


class LinkSender:
    """Encodes the tensors of one outgoing link, choosing a transport per tensor."""

    def __init__(self, protocol: Protocol, owner: str):
        self.protocol, self.owner = protocol, owner
        self.peer: node_group_pb2.Location | None = None
        self._where: str | None = None  # "process" | "host" | "other", once the peer said where it runs
        self._inline = TensorSender()
        self._subs: dict[str, TensorSender] = {}
        self._inline_below = self._inline_limit()

    def set_peer(self, peer: node_group_pb2.Location) -> None:
        self.peer = peer
        self._where = "process" if peer.process == PROCESS_TOKEN else "host" if peer.host_id == host_id() else "other"
        self._inline_below = self._inline_limit()
        log.info("link %s -> %s: %s", self.owner, peer.service or "?", self.describe())

    def describe(self) -> str:
        """The transports this link uses, for logs."""
        if self.protocol is not Protocol.AUTO:
            return f"forced {self.protocol.value}"
        p = self.peer
        if p is None:
            return "peer location not known yet: inline"
        if self._where == "process":
            return "same process: local hand-over"
        if self._where == "host":
            gpu = f"cuda_ipc for GPU tensors >= {CUDA_IPC_MIN_BYTES} B, " if p.gpu_uuids and self._cuda_ipc_ok() else ""
            return f"same host: {gpu}shm for host tensors >= {MIN_REF_BYTES} B, inline below"
        if self._mooncake_ok():
            return f"other host: mooncake ({p.mooncake_protocol}) for tensors >= {MOONCAKE_MIN_BYTES} B, inline below"
        why = "the peer has no Mooncake engine" if not p.mooncake_protocol else "this service has no Mooncake engine"
        return f"other host: inline ({why})"

    def _mooncake_ok(self) -> bool:
        from mstar.services.transport import mooncake

        return bool(self.peer and self.peer.mooncake_protocol) and mooncake.available()

    @staticmethod
    def _cuda_ipc_ok() -> bool:
        from mstar.services.transport import cuda_ipc

        return cuda_ipc.available()

    def pick(self, t: torch.Tensor) -> str:
        """Transport for one tensor: inline, shm, mooncake, cuda_ipc or local."""
        nbytes = t.nbytes
        big = nbytes >= MIN_REF_BYTES
        if self.protocol is Protocol.TCP:
            return "inline"
        if self.protocol is Protocol.SHM:
            return "shm" if big else "inline"
        if self.protocol is Protocol.RDMA:
            return "mooncake" if big else "inline"
        where = self._where
        if where == "process":
            return "local"
        if where is None or not big:
            return "inline"
        if where == "host":
            if t.is_cuda and nbytes >= CUDA_IPC_MIN_BYTES and self.peer.gpu_uuids and self._cuda_ipc_ok():
                return "cuda_ipc"
            return "shm"
        if nbytes >= MOONCAKE_MIN_BYTES and self._mooncake_ok():
            return "mooncake"
        return "inline"

    def _sub(self, kind: str) -> TensorSender:
        sub = self._subs.get(kind)
        if sub is None:
            sub = self._subs[kind] = _transport_class(kind, 0)(self.owner)
        return sub

    def _inline_limit(self) -> float:
        """Tensors of fewer bytes go inline whatever else ``pick`` weighs (most tensors: tokens,
        small chunks), so ``encode_into`` skips the choice for them."""
        if self.protocol is Protocol.TCP:
            return float("inf")
        if self.protocol is Protocol.AUTO and self._where == "process":
            return 0  # local hand-over at any size
        return MIN_REF_BYTES

    def encode_into(self, msg: pb.Tensor, name: str, t: torch.Tensor) -> str:
        """Encode ``t`` into ``msg``; returns the transport used."""
        if t.nbytes < self._inline_below:
            wire.fill_proto(msg, name, t)
            return "inline"
        kind = self.pick(t)
        if kind == "inline":
            self._inline.encode_into(msg, name, t)
            return kind
        self._sub(kind).encode_into(msg, name, t)
        payload = msg.WhichOneof("payload")
        if payload == "raw":  # the transport declined this one (e.g. too small for a segment)
            return "inline"
        ref = getattr(msg, payload)
        ref.buffer_id |= (_KINDS.index(payload) + 1) << _ID_SHIFT
        return payload

    def release(self, buffer_ids) -> None:
        by_kind: dict[str, list[int]] = {}
        for b in buffer_ids:
            kind = _KINDS[(b >> _ID_SHIFT) - 1]
            by_kind.setdefault(kind, []).append(pool_id(b))
        for kind, ids in by_kind.items():
            sub = self._subs.get(kind)
            if sub is not None:
                sub.release(ids)

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close()
        self._subs.clear()


#: a batch whose shared-memory / Mooncake payload is at least this big is decoded on a
#: worker thread, so the service's event loop (other streams, health checks) keeps going
OFFLOAD_BYTES = 4 << 20
_SLOW_PAYLOADS = ("shm", "mooncake")  # host copies / network reads; CUDA IPC copies are fast


class TensorReceiver:
    """Decodes tensors arriving on one incoming stream."""

    @staticmethod
    def slow_bytes(batch, frames=None) -> int:
        """Bytes of a FrameBatch (or of those of its ``frames``) that must be copied through host
        memory or read over the network."""
        n = 0
        for f in batch.frames if frames is None else frames:
            for t in f.tensors:
                kind = t.WhichOneof("payload")
                if kind in _SLOW_PAYLOADS:
                    n += getattr(t, kind).nbytes
        return n

    def decode_batch(self, batch, acks: list[int]) -> list[list[torch.Tensor] | Exception]:
        """Every frame's tensors in order, or the exception that decoding that frame raised
        (a transport failure ends that frame's request, not the stream)."""
        out, pooled = self._decode_inline(batch)
        if pooled:
            self.decode_frames(batch, pooled, out, acks)
        return out

    async def decode_batch_async(self, batch, acks: list[int]) -> list[list[torch.Tensor] | Exception]:
        """``decode_batch``, with the pooled payloads on a worker thread when they are big."""
        out, pooled = self._decode_inline(batch)
        if pooled:
            frames = batch.frames
            if self.slow_bytes(batch, [frames[i] for i in pooled]) >= OFFLOAD_BYTES:
                await asyncio.get_running_loop().run_in_executor(None, self.decode_frames, batch, pooled, out, acks)
            else:
                self.decode_frames(batch, pooled, out, acks)
        return out

    def _decode_inline(self, batch) -> tuple[list, list[int]]:
        """One pass over the batch (the common case: every tensor inline, small): the tensors of
        frames with only inline ones; None and the frame's index in the list for the others."""
        out: list = []
        pooled: list[int] = []
        from_bytes = wire.from_bytes
        for f in batch.frames:
            try:
                row = []
                for t in f.tensors:
                    if t.WhichOneof("payload") != "raw":
                        pooled.append(len(out))
                        row = None
                        break
                    row.append(from_bytes(t.raw, t.datatype, t.shape))
            except Exception as e:
                row = self._failed(batch, f, e)
            out.append(row)
        return out, pooled

    def decode_frames(self, batch, indices: list[int], out: list, acks: list[int]) -> None:
        """Decode the frames at ``indices`` of the batch into ``out`` (pooled payloads: acknowledged in ``acks``)."""
        frames = batch.frames
        for i in indices:
            f = frames[i]
            try:
                out[i] = [self.decode(t, acks) for t in f.tensors]
            except Exception as e:
                out[i] = self._failed(batch, f, e)

    @staticmethod
    def _failed(batch, f, e: Exception) -> Exception:
        log.warning("cannot decode a tensor of request %s from %s: %s: %s", f.request_id, batch.sender, type(e).__name__, e)
        return e

    def __init__(self) -> None:
        self._readers: dict[str, object] = {}

    def _reader(self, kind: str):
        r = self._readers.get(kind)
        if r is None:
            r = self._readers[kind] = _transport_class(kind, 1)()
        return r

    def decode(self, msg: pb.Tensor, acks: list[int]) -> torch.Tensor:
        kind = msg.WhichOneof("payload")
        if kind == "raw":
            return wire.from_bytes(msg.raw, msg.datatype, msg.shape)
        if kind is None:
            return wire.from_proto(msg)  # raises: no payload
        return self._reader(kind).read(msg, acks)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
