"""CUDA IPC transport: GPU tensors between processes of one host, device to device.

Sender (one per link, :class:`CudaIpcSender`): pooled CUDA allocations by size class.
An *arena* is one ``cudaMalloc`` whose IPC handle is exported once, when it is
allocated. Size classes under ``ARENA_BYTES`` are carved into slots of a shared arena;
bigger classes get an arena per slot. ``encode_into`` copies the tensor device to device
into a free slot on the tensor's device and waits for the copy (and the producer's work
queued before it) to finish before the frame can leave; the frame carries the arena's
handle, the slot's offset and a buffer id. A slot goes back to the pool only when the
receiver acknowledges its id (``release``).

Receiver (one per stream, :class:`CudaIpcReader`): opens each handle once
(``cudaIpcOpenMemHandle`` costs milliseconds) in a process-wide cache, shared and
reference counted by every reader of the process because CUDA maps a handle only once
per process; copies the bytes device to device into a fresh tensor, waits for that copy,
and acknowledges the id. The tensor lands on the local GPU whose UUID matches the ref's
``device_uuid`` (the GPU that holds the bytes); when the receiver does not see that GPU it
lands on the current device, over peer access. ``close`` closes the handles nothing else
in the process uses.

Lifetime. The producer never reuses a slot before its ack, and never frees an arena a
receiver may still be reading. When a link closes (``close``), arenas whose slots are
all acknowledged or were never used are freed at once. An arena with an unacknowledged
slot may still be under a receiver's copy: the frame may have reached a receiver that
is alive but has not read it yet (a stream cancelled by this side, a receiver stuck
behind its own work). Such arenas are *retired*: kept, never reused, and freed by
``reap()`` once ``RETIRE_GRACE_S`` has passed (every later ``close`` and every new
allocation in the process reaps). Frames still queued on a broken stream are never
delivered, so after the grace only a receiver that stalled longer than the grace
inside one copy could see freed memory; a process that exits frees everything anyway.

The CUDA runtime is reached through ctypes (the ``libcudart`` that PyTorch loaded, where
it can be found); nothing touches CUDA before the first tensor, so importing this module
on a machine without a GPU is fine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import itertools
import logging
import os
import threading
import time

import torch

from mstar import wire
from mstar.services.transport.base import MIN_REF_BYTES, TensorSender
from mstar.v1 import tensor_pb2 as pb

log = logging.getLogger(__name__)

#: slots of size classes below this share one allocation; larger classes get their own
ARENA_BYTES = 2 << 20
#: how long an arena with an unacknowledged slot outlives the link that closed over it
RETIRE_GRACE_S = 30.0
IPC_HANDLE_BYTES = 64
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_ERROR_MEMORY_ALLOCATION = 2


class CudaIpcError(RuntimeError):
    pass


def available() -> bool:
    """CUDA is usable in this process and the runtime's IPC calls can be reached."""
    return torch.cuda.is_available() and unavailable_reason() == ""


@functools.cache
def unavailable_reason() -> str:
    if not torch.cuda.is_available():
        return "torch.cuda is not available"
    try:
        _cudart()  # no CUDA context yet: a CPU service on a GPU host asking stays off the GPU
    except CudaIpcError as e:
        return str(e)
    return ""


def size_class(nbytes: int) -> int:
    """Powers of two from MIN_REF_BYTES; above 4 MiB also 1.5 × a power of two (6, 12,
    24 MiB ...), so a big tensor wastes at most a third of its slot; every class from
    2 MiB on is a whole multiple of the 2 MiB that cudaMalloc rounds to."""
    size = MIN_REF_BYTES
    while size < nbytes:
        size *= 2
    if size >= 8 << 20 and size * 3 // 4 >= nbytes:
        size = size * 3 // 4
    return size


def _normalize_uuid(uuid: str) -> str:
    u = uuid.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


class _Span:
    """A device allocation seen through __cuda_array_interface__ (bytes), so torch can view it."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}  # None: nothing to wait for


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def _cudart_candidates() -> list[str]:
    found: list[str] = []
    try:  # the runtime torch itself loaded: one runtime state for both
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libcudart.so"):
                    found.append(parts[5].strip())
    except OSError:
        pass
    try:
        import nvidia  # the CUDA runtime wheels torch depends on

        for root in nvidia.__path__:
            found += sorted(glob.glob(os.path.join(root, "*", "lib", "libcudart.so*")), reverse=True)
    except ImportError:
        pass
    lib = ctypes.util.find_library("cudart")
    found += ([lib] if lib else []) + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    return list(dict.fromkeys(found))


@functools.cache
def _cudart() -> tuple[ctypes.CDLL, str]:
    """The CUDA runtime library, with its signatures set. Loading it starts nothing on the GPU."""
    tried = []
    for path in _cudart_candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.cudaIpcOpenMemHandle  # noqa: B018 (raises AttributeError when missing)
        except (OSError, AttributeError) as e:
            tried.append(f"{path}: {e}")
            continue
        break
    else:
        raise CudaIpcError("no CUDA runtime library with IPC calls could be loaded (" + "; ".join(tried) + ")")
    c_void_p, c_size_t, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    for name, args in (("cudaMalloc", [ctypes.POINTER(c_void_p), c_size_t]), ("cudaFree", [c_void_p]),
                       ("cudaSetDevice", [c_int]), ("cudaGetLastError", []),
                       ("cudaIpcGetMemHandle", [ctypes.POINTER(_IpcHandle), c_void_p]),
                       ("cudaIpcOpenMemHandle", [ctypes.POINTER(c_void_p), _IpcHandle, ctypes.c_uint]),
                       ("cudaIpcCloseMemHandle", [c_void_p])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, c_int
    lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [c_int], ctypes.c_char_p
    return lib, path


class _CudaRuntime:
    """The CUDA runtime calls this transport makes, and the copies it makes through torch."""

    def __init__(self) -> None:
        torch.cuda.init()
        self.lib, path = _cudart()
        self.path = path
        self._uuids = [_normalize_uuid(str(torch.cuda.get_device_properties(i).uuid))
                       for i in range(torch.cuda.device_count())]
        self._streams: dict[int, torch.cuda.Stream] = {}
        log.debug("cuda_ipc: CUDA runtime %s", path)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.lib.cudaGetLastError()  # clear it, or torch's next launch check would report it
            raise CudaIpcError(f"{what}: {self.lib.cudaGetErrorString(rc).decode()} (cudaError {rc})")

    def uuid(self, device: int) -> str:
        """As nvidia-smi prints it."""
        return "GPU-" + self._uuids[device]

    def device_for(self, uuid: str) -> int:
        """The local GPU with this UUID, else the current device (reached over peer access)."""
        try:
            return self._uuids.index(_normalize_uuid(uuid))
        except ValueError:
            return torch.cuda.current_device()

    @staticmethod
    def device_of(t: torch.Tensor) -> int:
        """The GPU a tensor's slot lives on: its own, or the current one for a host tensor."""
        return t.device.index if t.is_cuda else torch.cuda.current_device()

    def malloc(self, device: int, size: int) -> int:
        p = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
            rc = self.lib.cudaMalloc(ctypes.byref(p), size)
            if rc == _ERROR_MEMORY_ALLOCATION:  # torch may be caching what we need
                self.lib.cudaGetLastError()
                torch.cuda.empty_cache()
                rc = self.lib.cudaMalloc(ctypes.byref(p), size)
            self._check(rc, f"cudaMalloc({size}) on cuda:{device}")
        return p.value

    def free(self, device: int, ptr: int) -> None:
        with torch.cuda.device(device):
            self._check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
            self._check(self.lib.cudaFree(ptr), "cudaFree")

    def export(self, device: int, ptr: int) -> bytes:
        h = _IpcHandle()
        with torch.cuda.device(device):
            self._check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
            self._check(self.lib.cudaIpcGetMemHandle(ctypes.byref(h), ptr), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)

    def open(self, device: int, handle: bytes) -> int:
        h = _IpcHandle.from_buffer_copy(handle)
        p = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
            self._check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(p), h, _IPC_LAZY_ENABLE_PEER_ACCESS),
                        f"cudaIpcOpenMemHandle on cuda:{device}")
        return p.value

    def close(self, device: int, ptr: int) -> None:
        with torch.cuda.device(device):
            self._check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
            self._check(self.lib.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")

    @staticmethod
    def view(device: int, ptr: int, size: int) -> torch.Tensor:
        """The allocation as a uint8 tensor that does not own it."""
        return torch.as_tensor(_Span(ptr, size), device=torch.device("cuda", device))

    @staticmethod
    def copy_in(dst: torch.Tensor, t: torch.Tensor) -> None:
        """``t`` into ``dst`` (a uint8 slice of an arena) on the current stream, waited for."""
        with torch.cuda.device(dst.device):
            dst.view(t.dtype).view(t.shape).copy_(t.detach())
            done = torch.cuda.Event()
            done.record()
            done.synchronize()

    def copy_out(self, src: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
        """A new tensor holding ``src``'s bytes, on ``src``'s device. The copy runs on a side
        stream, so the wait covers it alone and not the work queued on the current stream;
        the result is then handed to the current stream."""
        device = src.device.index
        with torch.cuda.device(device):
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)
            with torch.cuda.stream(side):
                out = torch.empty(shape, dtype=dtype, device=src.device)
                if src.numel():
                    out.view(-1).view(torch.uint8).copy_(src)
            side.synchronize()
            out.record_stream(torch.cuda.current_stream(device))
        return out


_rt: _CudaRuntime | None = None
_rt_lock = threading.Lock()


def _runtime() -> _CudaRuntime:
    global _rt
    with _rt_lock:
        if _rt is None:
            if not torch.cuda.is_available():
                raise CudaIpcError("CUDA IPC needs a GPU: torch.cuda is not available in this process")
            _rt = _CudaRuntime()
        return _rt


# ---------------------------------------------------------------------------------------
# sender: pooled, exported arenas

class _Arena:
    __slots__ = ("device", "ptr", "size", "handle", "uuid", "view", "slot_size", "slot_ids")

    def __init__(self, rt: _CudaRuntime, device: int, size: int, slot_size: int):
        self.device, self.size, self.slot_size = device, size, slot_size
        self.ptr = rt.malloc(device, size)
        try:
            self.handle = rt.export(device, self.ptr)
            self.view = rt.view(device, self.ptr, size)
        except BaseException:
            rt.free(device, self.ptr)
            raise
        self.uuid = rt.uuid(device)
        self.slot_ids: list[int] = []

    def free(self, rt: _CudaRuntime) -> None:
        self.view = None
        rt.free(self.device, self.ptr)


_ids = itertools.count(1)  # slot ids, unique in the process (< 2**48 for any plausible lifetime)
_state_lock = threading.Lock()
_live: dict[int, _Arena] = {}  # id(arena) -> arena: every arena this process holds
_exported: dict[bytes, _Arena] = {}  # handle -> arena, for a reader in the exporting process
_retired: list[tuple[float, _Arena]] = []  # (free after, arena)


def live_allocations() -> int:
    """Arenas this process holds, in a pool or retired (for leak checks)."""
    with _state_lock:
        return len(_live)


def retired_allocations() -> int:
    with _state_lock:
        return len(_retired)


def _drop(arena: _Arena) -> None:
    with _state_lock:
        _live.pop(id(arena), None)
        _exported.pop(arena.handle, None)
    arena.free(_runtime())


def reap(now: float | None = None) -> int:
    """Free retired arenas whose grace has passed; returns how many."""
    now = time.monotonic() if now is None else now
    with _state_lock:
        due = [a for t, a in _retired if t <= now]
        _retired[:] = [(t, a) for t, a in _retired if t > now]
    for arena in due:
        _drop(arena)
    return len(due)


class CudaIpcSender(TensorSender):
    """Pool of exported CUDA arenas for one outgoing link; a slot holds one tensor at a time."""

    def __init__(self, owner: str):
        self.owner = owner
        self._arenas: list[_Arena] = []
        self._slots: dict[int, tuple[_Arena, int]] = {}  # slot id -> (arena, offset)
        self._free: dict[tuple[int, int], list[int]] = {}  # (device, size class) -> slot ids
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self.allocations = 0  # arenas allocated (and exported) over this sender's life

    def encode_into(self, msg: pb.Tensor, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if nbytes < MIN_REF_BYTES:
            wire.fill_proto(msg, name, t)
            return
        datatype = wire.wire_dtype(t.dtype)
        rt = _runtime()
        device = rt.device_of(t)
        slot_id, arena, offset = self._take(rt, device, nbytes)
        try:
            rt.copy_in(arena.view[offset : offset + nbytes], t)
        except BaseException:
            self.release([slot_id])
            raise
        msg.name, msg.datatype = name, datatype
        msg.shape.extend(t.shape)
        ref = msg.cuda_ipc
        ref.handle, ref.offset, ref.nbytes, ref.buffer_id = arena.handle, offset, nbytes, slot_id
        ref.device_uuid, ref.allocation_size = arena.uuid, arena.size

    def _take(self, rt: _CudaRuntime, device: int, nbytes: int) -> tuple[int, _Arena, int]:
        size = size_class(nbytes)
        with self._lock:
            free = self._free.setdefault((device, size), [])
            if not free:
                reap()
                arena = _Arena(rt, device, max(size, ARENA_BYTES), size)
                self.allocations += 1
                self._arenas.append(arena)
                with _state_lock:
                    _live[id(arena)] = arena
                    _exported[arena.handle] = arena
                for offset in range(0, arena.size - size + 1, size):
                    slot_id = next(_ids)
                    arena.slot_ids.append(slot_id)
                    self._slots[slot_id] = (arena, offset)
                free.extend(reversed(arena.slot_ids))
                log.debug("cuda_ipc %s: arena of %d B on cuda:%d (%d slots of %d B)", self.owner, arena.size,
                          device, len(arena.slot_ids), size)
            slot_id = free.pop()
            self._busy.add(slot_id)
            arena, offset = self._slots[slot_id]
        return slot_id, arena, offset

    def release(self, buffer_ids) -> None:
        with self._lock:
            for slot_id in buffer_ids:
                if slot_id in self._busy:  # repeated and unknown ids are ignored
                    self._busy.discard(slot_id)
                    arena, _ = self._slots[slot_id]
                    self._free[(arena.device, arena.slot_size)].append(slot_id)

    def close(self) -> None:
        """Free every arena no receiver may still be reading; retire the others (module doc)."""
        with self._lock:
            arenas, busy = self._arenas, set(self._busy)
            self._arenas, self._slots, self._free, self._busy = [], {}, {}, set()
        deadline = time.monotonic() + RETIRE_GRACE_S
        retired = 0
        for arena in arenas:
            if busy.intersection(arena.slot_ids):
                with _state_lock:
                    _retired.append((deadline, arena))
                retired += 1
            else:
                _drop(arena)
        if retired:
            log.info("cuda_ipc %s: link closed with %d arena(s) not acknowledged; freeing them in %.0f s",
                     self.owner, retired, RETIRE_GRACE_S)
        if _rt is not None:
            reap()

    def is_free(self, slot_id: int) -> bool:
        with self._lock:
            return slot_id in self._slots and slot_id not in self._busy

    @property
    def in_flight(self) -> int:
        """Slots sent and not yet acknowledged."""
        with self._lock:
            return len(self._busy)


# ---------------------------------------------------------------------------------------
# receiver: opened handles, cached process-wide

class _Mapping:
    __slots__ = ("handle", "device", "ptr", "size", "view", "refs", "foreign")

    def __init__(self, handle: bytes, device: int, ptr: int, size: int, view: torch.Tensor, foreign: bool):
        self.handle, self.device, self.ptr, self.size, self.view = handle, device, ptr, size, view
        self.refs, self.foreign = 0, foreign


_opened: dict[bytes, _Mapping] = {}


def open_mappings() -> int:
    """Handles of other processes this process holds open (for leak checks)."""
    with _state_lock:
        return sum(1 for m in _opened.values() if m.foreign)


def _acquire(rt: _CudaRuntime, ref: pb.CudaIpcRef) -> _Mapping:
    handle = bytes(ref.handle)
    with _state_lock:
        m = _opened.get(handle)
        if m is None:
            own = _exported.get(handle)
            if own is not None:  # exported by this very process: CUDA refuses to open it here
                m = _Mapping(handle, own.device, own.ptr, own.size, own.view, foreign=False)
            else:
                device = rt.device_for(ref.device_uuid)
                ptr = rt.open(device, handle)
                m = _Mapping(handle, device, ptr, ref.allocation_size, rt.view(device, ptr, ref.allocation_size),
                             foreign=True)
            _opened[handle] = m
        m.refs += 1
        return m


def _unref(rt: _CudaRuntime | None, handle: bytes) -> None:
    with _state_lock:
        m = _opened.get(handle)
        if m is None:
            return
        m.refs -= 1
        if m.refs > 0:
            return
        del _opened[handle]
        m.view = None
    if m.foreign and rt is not None:
        rt.close(m.device, m.ptr)


class CudaIpcReader:
    """Opens the handles named in incoming frames (cached) and copies tensors out."""

    def __init__(self) -> None:
        self._handles: dict[bytes, _Mapping] = {}  # handles this reader holds a reference to

    def read(self, msg: pb.Tensor, acks: list[int]) -> torch.Tensor:
        ref = msg.cuda_ipc
        try:
            if len(ref.handle) != IPC_HANDLE_BYTES:
                raise CudaIpcError(f"tensor '{msg.name}': a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, "
                                   f"got {len(ref.handle)}")
            dtype = wire.torch_dtype(msg.datatype)
            count = 1
            for s in msg.shape:
                count *= s
            if count * torch.empty((), dtype=dtype).element_size() != ref.nbytes:
                raise wire.WireError(f"tensor of shape {list(msg.shape)} {msg.datatype} does not fill "
                                     f"{ref.nbytes} bytes")
            rt = _runtime()
            handle = bytes(ref.handle)
            m = self._handles.get(handle)
            if m is None:
                m = self._handles[handle] = _acquire(rt, ref)
            if ref.offset + ref.nbytes > m.size:
                raise CudaIpcError(f"tensor '{msg.name}': bytes {ref.offset}..{ref.offset + ref.nbytes} lie "
                                   f"outside the {m.size} B allocation")
            return rt.copy_out(m.view[ref.offset : ref.offset + ref.nbytes], dtype, list(msg.shape))
        finally:
            acks.append(ref.buffer_id)  # even on failure: nothing more will come of this buffer

    def close(self) -> None:
        handles, self._handles = list(self._handles), {}
        for handle in handles:
            _unref(_rt, handle)
