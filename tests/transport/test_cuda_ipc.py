"""CUDA IPC transport.

On a GPU: a receiving service in another process (spawned) with an Exchange servicer like
a node group's, fed by a real ``Link`` over gRPC on loopback under Protocol.AUTO: bytes
equal for several dtypes and sizes, cuda_ipc chosen for GPU tensors (shm for host ones,
inline for small ones), slots reused only after their ack, unacknowledged arenas retired
on close and freed after the grace, nothing left open on either side after close.

Everywhere: the choice of transport, the CPU-only paths, and the sender's pool and the
reader's handle cache run against a stand-in CUDA runtime backed by host memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import queue
import time
from collections import Counter

import grpc
import pytest
import torch

from mstar import wire
from mstar.services.transport import cuda_ipc
from mstar.services.transport.base import CUDA_IPC_MIN_BYTES, LinkSender, Protocol, TensorReceiver, pool_id
from mstar.services.transport.location import host_id, local_location
from mstar.v1 import node_group_pb2, node_group_pb2_grpc
from mstar.v1 import tensor_pb2 as pb

KIB, MIB = 1 << 10, 1 << 20
GPU = pytest.mark.skipif(not cuda_ipc.available(), reason=f"needs CUDA: {cuda_ipc.unavailable_reason()}")


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(bytes(wire.tensor_bytes(t))).hexdigest()


def make(dtype: torch.dtype, nbytes: int, device: str) -> torch.Tensor:
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point:
        return torch.randn(n, device=device).to(dtype)
    if dtype is torch.bool:
        return torch.rand(n, device=device) > 0.5
    lo, hi = (0, 256) if dtype is torch.uint8 else (-(1 << 30), 1 << 30)
    return torch.randint(lo, hi, (n,), device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------
# the receiving process


class _Exchange(node_group_pb2_grpc.NodeGroupServicer):
    """A node group's Exchange, reporting what each tensor decoded to. A frame whose request
    id starts with "hold" withholds its batch's acks until the test says so."""

    def __init__(self, reports, control, device: str):
        self.reports, self.control, self.device = reports, control, device

    async def Exchange(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        receiver = TensorReceiver()
        yield node_group_pb2.Ack(receiver=local_location("receiver", self.device))
        try:
            async for batch in request_iterator:
                acks: list[int] = []
                for frame in batch.frames:
                    for msg in frame.tensors:
                        t = receiver.decode(msg, acks)
                        self.reports.put({"request": frame.request_id, "payload": msg.WhichOneof("payload"),
                                          "dtype": str(t.dtype), "shape": list(t.shape), "device": str(t.device),
                                          "digest": digest(t), "open_mappings": cuda_ipc.open_mappings()})
                    if frame.request_id.startswith("hold"):
                        await loop.run_in_executor(None, self.control.get)
                if acks:
                    yield node_group_pb2.Ack(released_buffer_ids=acks)
        finally:
            receiver.close()
            self.reports.put({"closed": True, "open_mappings": cuda_ipc.open_mappings()})


async def _serve(reports, control, device: str) -> None:
    from mstar.services.links import SERVER_OPTIONS

    server = grpc.aio.server(options=SERVER_OPTIONS)
    node_group_pb2_grpc.add_NodeGroupServicer_to_server(_Exchange(reports, control, device), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    reports.put({"port": port})
    await server.wait_for_termination()


def _receiver_main(reports, control, device: str) -> None:
    asyncio.run(_serve(reports, control, device))


class Receiver:
    def __init__(self, device: str = "cuda:0"):
        ctx = mp.get_context("spawn")
        self.reports, self.control = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_receiver_main, args=(self.reports, self.control, device), daemon=True)
        self.proc.start()
        self.address = f"127.0.0.1:{self.get()['port']}"

    def get(self, timeout: float = 60.0) -> dict:
        try:
            return self.reports.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no report from the receiving process (alive: {self.proc.is_alive()})") from None

    async def next(self) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, self.get)

    async def closed(self) -> dict:
        while True:
            r = await self.next()
            if r.get("closed"):
                return r

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.join(10)


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.stop()


async def _until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def _open_link(address: str):
    from mstar.services.links import Link

    link = Link("sender", "receiver", address, "exchange", Protocol.AUTO, lambda *_: None)
    link.send(node_group_pb2.Frame(request_id="hello"))  # opens the stream; the first ack names the receiver
    await _until(lambda: link._tensors.peer is not None, what="the receiver's location")
    return link


def _send(link, request_id: str, t: torch.Tensor) -> pb.Tensor:
    frame = node_group_pb2.Frame(request_id=request_id)
    link.send(frame, [("x", t)])
    return frame.tensors[0]


# ---------------------------------------------------------------------------------------
# on a GPU, across processes, through gRPC


@GPU
@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_round_trip_between_processes_through_a_link(receiver):
    async def scenario():
        link = await _open_link(receiver.address)
        assert "cuda_ipc for GPU tensors" in link._tensors.describe()
        cases = [(dt, n) for n in (64 * KIB, 1 * MIB, 16 * MIB)
                 for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
                            torch.bool)]
        tensors = [make(dt, n, "cuda") for dt, n in cases]
        tensors += [make(torch.float32, 8 * MIB, "cuda").view(1024, -1).t(),  # not contiguous
                    make(torch.float16, 2 * 100_003, "cuda").view(1, -1),  # odd byte count
                    make(torch.float64, 96 * MIB, "cuda").view(-1, 4, 64)]  # a 1.5 × 2^k class
        for i, t in enumerate(tensors):
            msg = _send(link, f"r{i}", t)
            # below CUDA_IPC_MIN_BYTES the host round trip is as fast: shared memory
            want = "cuda_ipc" if t.numel() * t.element_size() >= CUDA_IPC_MIN_BYTES else "shm"
            assert msg.WhichOneof("payload") == want, (t.dtype, t.shape)
            assert msg.ByteSize() < 300  # a reference, not the bytes
            if want == "cuda_ipc":
                ref = msg.cuda_ipc
                assert len(ref.handle) == 64 and ref.nbytes == t.numel() * t.element_size()
                assert ref.offset + ref.nbytes <= ref.allocation_size and 0 < pool_id(ref.buffer_id) < 2**48
                assert ref.device_uuid == "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
            r = await receiver.next()
            # shared memory delivers host tensors (the receiving node moves them to its device)
            assert r["request"] == f"r{i}" and r["payload"] == want
            assert r["device"] == ("cuda:0" if want == "cuda_ipc" else "cpu")
            assert r["dtype"] == str(t.dtype) and r["shape"] == list(t.shape) and r["digest"] == digest(t), i
        sub = link._tensors._subs["cuda_ipc"]
        assert r["open_mappings"] <= sub.allocations  # each arena opened once, whatever number of tensors
        # small tensors stay inline; host tensors take shared memory
        for name, t, payload in (("small", make(torch.float32, 4 * KIB, "cuda"), "raw"),
                                 ("host", make(torch.float32, 1 * MIB, "cpu"), "shm")):
            assert _send(link, name, t).WhichOneof("payload") == payload
            r = await receiver.next()
            assert r["payload"] == payload and r["digest"] == digest(t)
        await _until(lambda: sub.in_flight == 0, what="every ack")
        assert cuda_ipc.live_allocations() == sub.allocations > 0
        await link.close()
        assert cuda_ipc.live_allocations() == 0 and cuda_ipc.retired_allocations() == 0
        assert (await receiver.closed())["open_mappings"] == 0

    asyncio.run(scenario())


@GPU
@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_slots_reused_only_after_ack_and_unacked_arenas_retired_on_close(receiver):
    async def scenario():
        link = await _open_link(receiver.address)
        a_t, b_t, c_t = (make(torch.float32, 4 * MIB, "cuda") for _ in range(3))
        a = _send(link, "hold-a", a_t).cuda_ipc  # the receiver reads it and withholds the ack
        assert (await receiver.next())["digest"] == digest(a_t)
        sub = link._tensors._subs["cuda_ipc"]
        assert not sub.is_free(pool_id(a.buffer_id)) and sub.allocations == 1
        b = _send(link, "b", b_t).cuda_ipc  # same class, a not acknowledged: another arena
        assert b.handle != a.handle and sub.allocations == 2
        receiver.control.put("go")  # the ack for a, then b read and acknowledged
        assert (await receiver.next())["digest"] == digest(b_t)
        await _until(lambda: sub.in_flight == 0, what="the acks")
        c = _send(link, "c", c_t).cuda_ipc
        assert c.handle in (a.handle, b.handle) and sub.allocations == 2  # reused, nothing allocated
        assert (await receiver.next())["digest"] == digest(c_t)
        await _until(lambda: sub.in_flight == 0, what="the ack for c")

        d_t = make(torch.bfloat16, 32 * MIB, "cuda")
        d = _send(link, "hold-d", d_t).cuda_ipc
        assert (await receiver.next())["digest"] == digest(d_t)
        await link.close()  # d is not acknowledged: its arena is kept, the others are freed
        assert cuda_ipc.live_allocations() == cuda_ipc.retired_allocations() == 1
        assert cuda_ipc.reap() == 0  # not before the grace
        receiver.control.put("go")
        assert (await receiver.closed())["open_mappings"] == 0
        assert cuda_ipc.reap(time.monotonic() + cuda_ipc.RETIRE_GRACE_S + 1) == 1
        assert cuda_ipc.live_allocations() == 0
        del d

    asyncio.run(scenario())


@GPU
@pytest.mark.gpu
def test_in_process_round_trip_and_bad_refs():
    """Sender and reader in one process (CUDA will not open a process's own handle: the
    reader uses the exporter's mapping), strided input, and refs that do not fit."""
    s, r = cuda_ipc.CudaIpcSender("t"), cuda_ipc.CudaIpcReader()
    try:
        t = torch.arange(3 * 1024 * 64, dtype=torch.float64, device="cuda").view(3, 1024, 64)[:, ::2]
        msg, acks = pb.Tensor(), []
        s.encode_into(msg, "t", t)
        got = r.read(msg, acks)
        assert torch.equal(got, t) and got.is_contiguous() and acks == [msg.cuda_ipc.buffer_id]
        got.add_(1)
        assert not torch.equal(got, t)  # the result owns its memory
        bad = pb.Tensor()
        bad.CopyFrom(msg)
        bad.cuda_ipc.offset = bad.cuda_ipc.allocation_size
        acks = []
        with pytest.raises(cuda_ipc.CudaIpcError, match="outside"):
            r.read(bad, acks)
        assert acks == [bad.cuda_ipc.buffer_id]
    finally:
        r.close()
        s.close()
    assert cuda_ipc.live_allocations() == cuda_ipc.retired_allocations() == 1  # never acknowledged
    assert cuda_ipc.reap(time.monotonic() + cuda_ipc.RETIRE_GRACE_S + 1) == 1


# ---------------------------------------------------------------------------------------
# everywhere


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without CUDA")
def test_without_cuda_small_tensors_inline_and_big_ones_fail_clearly():
    assert not cuda_ipc.available() and "torch.cuda is not available" in cuda_ipc.unavailable_reason()
    s = cuda_ipc.CudaIpcSender("t")
    msg = pb.Tensor()
    s.encode_into(msg, "small", torch.arange(10))
    assert msg.WhichOneof("payload") == "raw"
    with pytest.raises(cuda_ipc.CudaIpcError, match="needs a GPU"):
        s.encode_into(pb.Tensor(), "big", torch.zeros(1 * MIB, dtype=torch.uint8))
    s.close()
    cuda_ipc.CudaIpcReader().close()


class _FakeCudaTensor:
    is_cuda = True

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1


def test_link_sender_picks_cuda_ipc_only_for_gpu_tensors_to_gpu_peers_on_this_host(monkeypatch):
    monkeypatch.setattr(cuda_ipc, "available", lambda: True)
    link = LinkSender(Protocol.AUTO, "t")
    link.set_peer(node_group_pb2.Location(service="p", host_id=host_id(), process="another", gpu_uuids=["GPU-1"]))
    host, gpu, small = torch.zeros(1 * MIB, dtype=torch.uint8), _FakeCudaTensor(1 * MIB), _FakeCudaTensor(KIB)
    assert (link.pick(host), link.pick(gpu), link.pick(small)) == ("shm", "cuda_ipc", "inline")
    assert link.pick(_FakeCudaTensor(CUDA_IPC_MIN_BYTES - 1)) == "shm"  # host round trip is as fast there
    assert "cuda_ipc for GPU tensors" in link.describe()
    monkeypatch.setattr(cuda_ipc, "available", lambda: False)  # no CUDA here: host memory instead
    assert link.pick(gpu) == "shm" and "cuda_ipc" not in link.describe()
    monkeypatch.setattr(cuda_ipc, "available", lambda: True)
    link.set_peer(node_group_pb2.Location(service="p", host_id=host_id(), process="another"))  # CPU-only peer
    assert link.pick(gpu) == "shm"
    link.set_peer(node_group_pb2.Location(service="p", host_id="elsewhere", process="another", gpu_uuids=["GPU-1"]))
    assert link.pick(gpu) == "inline"  # another host, no Mooncake
    assert LinkSender(Protocol.SHM, "t").pick(gpu) == "shm"  # a forced protocol wins


def test_size_classes():
    assert [cuda_ipc.size_class(n) for n in (1, 64 * KIB, 64 * KIB + 1, 3 * MIB, 5 * MIB, 6 * MIB + 1, 7 * MIB)] \
        == [64 * KIB, 64 * KIB, 128 * KIB, 4 * MIB, 6 * MIB, 8 * MIB, 8 * MIB]
    for n in (2 * MIB, 5 * MIB, 100 * MIB, 257 * MIB):
        c = cuda_ipc.size_class(n)
        assert n <= c and c % (2 * MIB) == 0 and (c <= 4 * MIB or n > c * 2 / 3)  # wastes under a third


class FakeRuntime:
    """Host memory standing in for CUDA allocations; "opening" a handle aliases the memory at
    a new address, as another process would see it."""

    def __init__(self):
        self.mem: dict[int, torch.Tensor] = {}
        self.handles: dict[bytes, int] = {}
        self.opened: dict[int, int] = {}
        self.calls: Counter = Counter()
        self._next = 1 << 32

    def _addr(self, size: int) -> int:
        self._next += size + (1 << 20)
        return self._next

    def malloc(self, device, size):
        self.calls["malloc"] += 1
        ptr = self._addr(size)
        self.mem[ptr] = torch.zeros(size, dtype=torch.uint8)
        return ptr

    def free(self, device, ptr):
        self.calls["free"] += 1
        del self.mem[ptr]

    def export(self, device, ptr):
        handle = ptr.to_bytes(8, "little") * 8
        self.handles[handle] = ptr
        return handle

    def open(self, device, handle):
        self.calls["open"] += 1
        base = self.handles.get(handle)
        if base not in self.mem:
            raise cuda_ipc.CudaIpcError("cudaIpcOpenMemHandle: invalid resource handle")
        ptr = self._addr(0)
        self.opened[ptr] = base
        return ptr

    def close(self, device, ptr):
        self.calls["close"] += 1
        del self.opened[ptr]

    def uuid(self, device):
        return "GPU-fake"

    def device_for(self, uuid):
        return 0

    def device_of(self, t):
        return 0

    def view(self, device, ptr, size):
        return self.mem[self.opened.get(ptr, ptr)][:size]

    def copy_in(self, dst, t):
        dst.view(t.dtype).view(t.shape).copy_(t)

    def copy_out(self, src, dtype, shape):
        out = torch.empty(shape, dtype=dtype)
        out.view(-1).view(torch.uint8).copy_(src)
        return out


@pytest.fixture
def fake(monkeypatch):
    rt = FakeRuntime()
    for name, value in (("_rt", rt), ("_live", {}), ("_exported", {}), ("_retired", []), ("_opened", {})):
        monkeypatch.setattr(cuda_ipc, name, value)
    return rt


def _encode(s, t, name="x") -> pb.Tensor:
    msg = pb.Tensor()
    s.encode_into(msg, name, t)
    return msg


def test_pool_round_trip_reuse_after_ack_and_shared_small_arenas(fake):
    s, r = cuda_ipc.CudaIpcSender("t"), TensorReceiver()
    try:
        cases = [torch.randn(64, 1024).t(), torch.randn(100_003).to(torch.bfloat16), torch.rand(1 * MIB) > 0.5,
                 torch.randint(-(1 << 40), 1 << 40, (3, 5, 4096))]
        for t in cases:
            msg = _encode(s, t)
            assert msg.WhichOneof("payload") == "cuda_ipc" and list(msg.shape) == list(t.shape)
            acks: list[int] = []
            got = r.decode(msg, acks)
            assert got.dtype == t.dtype and torch.equal(got, t) and acks == [msg.cuda_ipc.buffer_id]
            s.release(acks)
        # 64 KiB slots share a 2 MiB arena
        before = fake.calls["malloc"]
        small = [_encode(s, torch.full((16 * KIB,), float(i))).cuda_ipc for i in range(3)]
        assert fake.calls["malloc"] == before + 1 and len({m.handle for m in small}) == 1
        assert sorted(m.offset for m in small) == [0, 64 * KIB, 128 * KIB] and small[0].allocation_size == 2 * MIB
        # a slot is not reused before its ack, and is after
        a = _encode(s, torch.ones(4 * MIB, dtype=torch.uint8)).cuda_ipc
        b = _encode(s, torch.ones(4 * MIB, dtype=torch.uint8)).cuda_ipc
        assert a.handle != b.handle and not s.is_free(a.buffer_id) and s.in_flight == 5
        s.release([a.buffer_id, a.buffer_id, 999_999])  # repeated and unknown ids are ignored
        assert s.is_free(a.buffer_id) and s.in_flight == 4
        c = _encode(s, torch.ones(4 * MIB - 3, dtype=torch.uint8)).cuda_ipc
        assert (c.handle, c.buffer_id) == (a.handle, a.buffer_id)
        assert fake.calls["open"] == 0  # the same process: the exporter's mapping, nothing opened
    finally:
        r.close()
        s.close()


def test_close_frees_acked_arenas_and_retires_the_others(fake):
    s = cuda_ipc.CudaIpcSender("t")
    done = _encode(s, torch.ones(4 * MIB, dtype=torch.uint8)).cuda_ipc
    pending = _encode(s, torch.ones(16 * MIB, dtype=torch.uint8)).cuda_ipc
    unused = _encode(s, torch.ones(1 * MIB, dtype=torch.uint8)).cuda_ipc
    s.release([done.buffer_id, unused.buffer_id])
    assert cuda_ipc.live_allocations() == 3
    s.close()
    assert fake.calls["free"] == 2 and cuda_ipc.live_allocations() == cuda_ipc.retired_allocations() == 1
    assert fake.handles[pending.handle] in fake.mem  # still readable
    assert not s.is_free(pending.buffer_id)  # gone from the pool: never reused
    assert cuda_ipc.reap() == 0
    assert cuda_ipc.reap(time.monotonic() + cuda_ipc.RETIRE_GRACE_S + 1) == 1
    assert cuda_ipc.live_allocations() == 0 and not fake.mem


def test_reader_opens_each_handle_once_per_process_and_closes_it_with_the_last_reader(fake):
    s = cuda_ipc.CudaIpcSender("t")
    msgs = [_encode(s, torch.full((16 * KIB,), float(i))) for i in range(3)]  # one arena
    cuda_ipc._exported.clear()  # as if the sender were another process
    r1, r2 = cuda_ipc.CudaIpcReader(), cuda_ipc.CudaIpcReader()
    for i, m in enumerate(msgs):
        assert torch.equal(r1.read(m, []), torch.full((16 * KIB,), float(i)))
    assert torch.equal(r2.read(msgs[1], []), torch.full((16 * KIB,), 1.0))
    assert fake.calls["open"] == 1 and cuda_ipc.open_mappings() == 1
    r1.close()
    assert fake.calls["close"] == 0 and cuda_ipc.open_mappings() == 1  # r2 still uses it
    r2.close()
    assert fake.calls["close"] == 1 and cuda_ipc.open_mappings() == 0 and not fake.opened
    s.close()


def test_reader_rejects_bad_refs_and_acknowledges_them(fake):
    s, r = cuda_ipc.CudaIpcSender("t"), cuda_ipc.CudaIpcReader()
    msg = _encode(s, torch.zeros(1 * MIB, dtype=torch.uint8))
    cuda_ipc._exported.clear()
    for field, value, error in (("offset", 2 * MIB, "outside"), ("handle", b"short", "64 bytes"),
                                ("nbytes", 12345, "does not fill")):
        bad = pb.Tensor()
        bad.CopyFrom(msg)
        setattr(bad.cuda_ipc, field, value)
        acks: list[int] = []
        with pytest.raises((cuda_ipc.CudaIpcError, wire.WireError), match=error):
            r.read(bad, acks)
        assert acks == [msg.cuda_ipc.buffer_id]
    s.release([msg.cuda_ipc.buffer_id])
    r.close()
    s.close()  # freed: a late read fails to open the handle, and is still acknowledged
    acks = []
    with pytest.raises(cuda_ipc.CudaIpcError, match="invalid resource handle"):
        cuda_ipc.CudaIpcReader().read(msg, acks)
    assert acks == [msg.cuda_ipc.buffer_id]
