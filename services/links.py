"""Outgoing long-lived frame streams, one per peer: the mesh's wiring.

A Link owns one bidirectional stream to a peer (a node group's Exchange or the
conductor's Report). Frames queued in the same event-loop tick are coalesced into
one FrameBatch; frames nobody waits for (a request's RELEASE) ride along with the next
message (``send_later``). When the stream breaks, every request that used the link since it
opened is reported to ``on_down`` so it can fail with a status naming the peer.

Links use the mesh's mutual TLS when it has certificates (mstar.tls). A link to an address
that only a request's routes named (not one the service was started with) first asks
``check_route`` whether the conductor announced it: until then nothing is sent, and if not, the
link goes down naming why, failing the requests that used it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import torch

from mstar import metrics
from mstar import tls as mtls
from mstar.limits import MAX_FRAME_MESSAGE_BYTES
from mstar.services.transport import LinkSender, Protocol
from mstar.v1 import conductor_pb2, node_group_pb2

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = MAX_FRAME_MESSAGE_BYTES
#: a peer that stops answering (host down, network cut) breaks the stream within
#: KEEPALIVE_S + KEEPALIVE_TIMEOUT_S instead of hanging until TCP gives up
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 2.0, 3.0
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
LINK_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [  # accept the links' keepalive pings
    *CHANNEL_OPTIONS,
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_S * 1000) // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
MAX_FRAMES_PER_BATCH = 512
MAX_COALESCE_PASSES = 4  # event-loop passes a message may wait for other requests' frames
#: how long a deferred frame (``Link.send_later``: a request's RELEASE) may wait to ride along
#: with the link's next message before it is sent on its own
DEFER_S = 0.005

OnDown = Callable[["Link", str, set[str]], None]  # (link, reason, request ids)
#: (peer group, address) -> None if the conductor announced that replica, else why not
CheckRoute = Callable[[str, str], Awaitable[str | None]]
#: how long a link remembers that its address was refused (a replica may join there later)
REFUSAL_TTL_S = 5.0


def _method(module, service: str, method: str) -> str:
    return f"/{module.DESCRIPTOR.services_by_name[service].full_name}/{method}"


#: the stream a link of each kind opens: NodeGroup.Exchange or WalkEvents.Report (FrameBatch -> Ack)
_METHODS = {"exchange": _method(node_group_pb2, "NodeGroup", "Exchange"),
            "report": _method(conductor_pb2, "WalkEvents", "Report")}
_FRAMES_TAG = 0x12  # FrameBatch.frames: field 2, length-delimited
assert node_group_pb2.FrameBatch.DESCRIPTOR.fields_by_name["frames"].number == 2
assert node_group_pb2.FrameBatch.DESCRIPTOR.fields_by_name["sender"].number == 1


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def batch_bytes(sender_field: bytes, frames: list[node_group_pb2.Frame]) -> bytes:
    """A serialized FrameBatch of ``frames``, written field by field: each frame is serialized
    once, where ``FrameBatch(frames=...)`` would first copy every frame into the batch (~0.7 µs a
    frame more). ``sender_field``: the batch's serialized ``sender`` field (``_sender_field``)."""
    parts = [sender_field]
    add = parts.append
    for f in frames:
        data = f.SerializeToString()
        n = len(data)
        add(bytes((_FRAMES_TAG, n)) if n < 0x80 else bytes((_FRAMES_TAG,)) + _varint(n))
        add(data)
    return b"".join(parts)


def _sender_field(name: str) -> bytes:
    return node_group_pb2.FrameBatch(sender=name).SerializeToString()


class Link:
    def __init__(self, sender_name: str, peer: str, address: str, kind: str, protocol: Protocol, on_down: OnDown,
                 tls: mtls.TLSSettings | None = None, check: CheckRoute | None = None):
        self.sender_name, self.peer, self.address, self.kind = sender_name, peer, address, kind
        self.protocol, self.tls = protocol, tls
        self._check = check  # set until the address is confirmed announced
        self._refused: tuple[float, str] | None = None  # (monotonic time, why) of the last refusal
        self._on_down = on_down
        self._channel: grpc.aio.Channel | None = None
        self._queue: asyncio.Queue[node_group_pb2.Frame] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._tensors: LinkSender | None = None
        self._requests: set[str] = set()
        self._last_request = ""  # of the frame queued last
        self._deferred: list[node_group_pb2.Frame] = []  # sent with the next message, or after DEFER_S
        self._defer_timer: asyncio.TimerHandle | None = None
        self._edges = metrics.EdgeMetrics(sender_name, peer)
        self._written = metrics.link_counts(sender_name, peer)  # [messages, frames]
        self._sender_field = _sender_field(sender_name)
        self.draining = False  # set by Links.drain: a link that goes down now is the shutdown, not a fault

    # -- sending -------------------------------------------------------------------------
    def send(self, frame: node_group_pb2.Frame, tensors: Sequence[tuple[str, torch.Tensor]] = ()) -> None:
        self._ensure_started()
        if tensors:
            sender, edges, clock = self._tensors, self._edges, time.perf_counter
            assert sender is not None
            for name, t in tensors:
                msg, t0 = frame.tensors.add(), clock()
                transport = sender.encode_into(msg, name, t)
                edges.sent(name, transport, t.nbytes, clock() - t0)
        rid = frame.request_id
        if rid:
            self._requests.add(rid)
        self._last_request = rid
        self._queue.put_nowait(frame)

    def send_later(self, frame: node_group_pb2.Frame) -> None:
        """Queue a frame (no tensors) that no request waits for, such as a RELEASE: it goes with
        the link's next message, or on its own after ``DEFER_S``. Under load that saves a gRPC
        message (~100 µs of CPU on either side) per frame; the peer frees the request's state
        at most ``DEFER_S`` later. Ordering is kept: it leaves after every frame sent before it."""
        self._ensure_started()
        self._deferred.append(frame)
        if self._defer_timer is None:
            self._defer_timer = asyncio.get_running_loop().call_later(DEFER_S, self._flush_deferred)

    def _flush_deferred(self) -> None:
        """Nothing took the deferred frames along in time: queue them for the writer."""
        self._defer_timer = None
        for frame in self._take_deferred():
            self._queue.put_nowait(frame)

    def _take_deferred(self) -> list[node_group_pb2.Frame]:
        frames, self._deferred = self._deferred, []
        if self._defer_timer is not None:
            self._defer_timer.cancel()
            self._defer_timer = None
        return frames

    def forget(self, request_id: str) -> None:
        self._requests.discard(request_id)

    def _ensure_started(self) -> None:
        """(Re)open the stream if it never opened or broke."""
        task = self._task
        if task is None or task.done():
            self._start()

    def _start(self) -> None:
        if self._channel is None:
            self._channel = mtls.aio_channel(self.address, self.tls, LINK_OPTIONS)
        self._tensors = LinkSender(self.protocol, self.sender_name)
        self._take_deferred()  # frames for a stream that broke: its peer lost that state anyway
        self._queue = asyncio.Queue()
        self._requests = set()
        self._task = asyncio.get_running_loop().create_task(self._run(self._tensors, self._queue))

    async def _write(self, call, queue: asyncio.Queue) -> None:
        """Coalesce queued frames into batches and write them until the call ends."""
        while True:
            frame = await queue.get()
            # let the producer finish its step; then keep the message open while other
            # requests are still adding to it (each message costs ~100 µs of CPU on either
            # side). A lone request's next steps do not hold it: that would delay its frames.
            for _ in range(MAX_COALESCE_PASSES):
                n = queue.qsize()
                await asyncio.sleep(0)
                if queue.qsize() == n or self._last_request == frame.request_id:
                    break
            frames = [frame]
            while not queue.empty() and len(frames) < MAX_FRAMES_PER_BATCH:
                frames.append(queue.get_nowait())
            if self._deferred and queue.empty():  # after everything queued before them
                frames.extend(self._take_deferred())
            written = self._written
            written[0] += 1
            written[1] += len(frames)
            try:
                await call.write(batch_bytes(self._sender_field, frames))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
                return  # the call ended; the reader reports why

    async def _verify(self) -> str | None:
        """None once the conductor confirmed this address (asked once), else why it is refused."""
        if self._check is None:
            return None
        if self._refused is not None and time.monotonic() - self._refused[0] < REFUSAL_TTL_S:
            return self._refused[1]
        why = await self._check(self.peer, self.address)
        if why is None:
            self._check, self._refused = None, None
        else:
            self._refused = (time.monotonic(), why)
            log.warning("link %s -> %s (%s) refused: %s", self.sender_name, self.peer, self.address, why)
        return why

    async def _run(self, tensors: LinkSender, queue: asyncio.Queue) -> None:
        assert self._channel is not None
        try:
            refused = await self._verify()
        except asyncio.CancelledError:
            tensors.close()
            raise
        if refused is not None:
            self._down(tensors, queue, refused, refused=True)
            return
        # messages go out already serialized (batch_bytes): no request serializer
        call = self._channel.stream_stream(_METHODS[self.kind], response_deserializer=node_group_pb2.Ack.FromString)()
        writer = asyncio.get_running_loop().create_task(self._write(call, queue))
        reason = "stream closed by peer"
        try:
            async for ack in call:
                if ack.HasField("receiver"):
                    tensors.set_peer(ack.receiver)
                if ack.released_buffer_ids:
                    tensors.release(ack.released_buffer_ids)
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            call.cancel()
            tensors.close()
            raise
        finally:
            writer.cancel()
        self._down(tensors, queue, reason)

    def _down(self, tensors: LinkSender, queue: asyncio.Queue, reason: str, refused: bool = False) -> None:
        """The stream ended (or was refused before it opened): report the requests it carried."""
        tensors.close()
        affected, self._requests = self._requests, set()
        while not queue.empty():
            f = queue.get_nowait()
            if f.request_id:
                affected.add(f.request_id)
        # A fault when it cost requests; a link with nothing in flight, or of a service that is
        # stopping itself, closing is how a mesh shuts down (it reconnects on the next frame).
        hurt = bool(affected) and not self.draining
        if not refused:
            log.log(logging.WARNING if hurt else logging.INFO, "link %s -> %s (%s) %s: %s; %d request(s) in flight",
                    self.sender_name, self.peer, self.address, "down" if hurt else "closed", reason, len(affected))
        self._on_down(self, f"{self.peer} ({self.address}) {'is refused' if refused else 'is unreachable'}: {reason}",
                      affected)

    async def close(self) -> None:
        # deferred RELEASEs are dropped, like frames still queued: node groups release every
        # request when their stream to the conductor ends (NodeGroupRuntime._on_link_down)
        self._take_deferred()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._channel is not None:
            await self._channel.close()


class Links:
    """The links of one service: one per peer replica (keyed by address), named by the
    peer's group. ``route`` finds the link a request's frames to a group take."""

    def __init__(self, sender_name: str, protocol: Protocol, on_down: OnDown, tls: mtls.TLSSettings | None = None,
                 check_route: CheckRoute | None = None):
        """``check_route``: ask it before opening a link to an address only a request's routes
        named (node groups); None trusts every route (the conductor makes the routes)."""
        self.sender_name, self.protocol, self._on_down = sender_name, protocol, on_down
        self.tls, self._check_route = tls, check_route
        self._links: dict[str, Link] = {}  # address -> link
        self._default: dict[str, str] = {}  # peer name -> address when a request names no replica
        self._draining = False

    def add(self, peer: str, address: str, kind: str = "exchange") -> Link:
        """A peer known at start (the conductor; node groups from --peers)."""
        self._default[peer] = address
        return self.to(peer, address, kind)

    def to(self, peer: str, address: str, kind: str = "exchange", check: bool = False) -> Link:
        link = self._links.get(address)
        if link is None:
            link = self._links[address] = Link(self.sender_name, peer, address, kind, self.protocol, self._on_down,
                                               self.tls, self._check_route if check else None)
            link.draining = self._draining
        elif link.peer != peer:  # one address is one replica of one group: routes cannot relabel it
            raise KeyError(f"route to node group '{peer}' names {address}, which is a replica of '{link.peer}'")
        return link

    def route(self, peer: str, routes) -> Link:
        """The link to ``peer``'s replica named in ``routes`` (a request's pinned replicas),
        or to its only statically known address."""
        address = routes.get(peer) or self._default.get(peer)
        if address is None:
            raise KeyError(f"no replica of node group '{peer}' is known to '{self.sender_name}' (the request carries no "
                           f"route to it and --peers does not name it)")
        return self.to(peer, address, check=address != self._default.get(peer))

    def __getitem__(self, peer: str) -> Link:
        return self._links[self._default[peer]]

    def forget(self, request_id: str) -> None:
        for link in self._links.values():
            link.forget(request_id)

    def drain(self) -> None:
        """This service is stopping: peers stopping too (a whole mesh shut down at once) are
        expected, so their links going down is logged at INFO, not as a fault."""
        self._draining = True
        for link in self._links.values():
            link.draining = True

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self._links.values()))
