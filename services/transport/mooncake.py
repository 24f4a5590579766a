"""Mooncake transfer-engine transport: pooled, registered buffers read one-sided by the receiver.

The sender copies a tensor's bytes into a slot of memory registered with this process's
Mooncake transfer engine and puts only a ``MooncakeRef`` (its engine session, the slot's
address, the byte count and a buffer id) into the frame: large tensors never travel inside
protobuf. The receiver reads the bytes with a one-sided transfer (``transfer_sync_read``)
into a registered staging slot of its own (``READ_CHUNK_BYTES`` at a time), copies them into
a fresh tensor and acknowledges the buffer id; only then does the sender reuse the slot.
``close()`` deregisters and frees every slot, acknowledged or not.

Memory is registered once per *arena* (at least ``ARENA_MIN_BYTES``, cut into equal
power-of-two slots of one size class), never per tensor: registering memory is slow on RDMA
NICs and republishes the segment's metadata to peers.

Engine set-up. One engine per process (``engine()``), started lazily on first use, in
Mooncake's P2P handshake mode (metadata ``"P2PHANDSHAKE"``: no metadata server; the reader
fetches the sender's segment descriptor from the sender itself), so a session id is
``"<host>:<rpc_port>"`` with a port the engine picks (``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``,
15000-17000 by default): several processes share a host without configuration.
``configure(host)`` names the address peers reach this process on (the IP a service serves
on; a network namespace counts as a host of its own) and picks the protocol: ``rdma`` where
the host has RDMA devices, ``tcp`` otherwise.

Without ``configure()`` the engine uses 127.0.0.1 when something needs it (tests, one
process) and ``advertise()`` offers nothing: AUTO sends Mooncake refs only to peers on other
hosts, and a loopback session is wrong there (a reader on another host would dial its own
loopback). A service calls ``configure()`` at start-up, before it advertises its location
(``base.configure_service``): under AUTO when it binds an address other hosts reach, under a
forced ``--tensor-comm-protocol RDMA`` always (loopback too: every peer sends it refs), and
then starts the engine at once, refusing to serve if it cannot.

Failures. A read that fails raises ``MooncakeError`` naming the sender's session (and is
acknowledged all the same). Refused connections and unknown hosts fail at once; a peer that
accepts connections but never answers (a stopped process, a black-holed link) fails after
``read_timeout_s`` (``MSTAR_CONNECT_TIMEOUT_S``, plus time for the size), because native
calls run on worker threads the caller stops waiting for, and Mooncake's TCP status /
progress / connect timeouts default to the same seconds here instead of 30.

Packages: ``mooncake-transfer-engine`` on GPU (CUDA) hosts, ``mooncake-transfer-engine-non-cuda``
elsewhere (pyproject extras ``mooncake`` / ``mooncake-cpu``); both install ``mooncake.engine``
and link the system's libibverbs1 (plus libnuma1, libcurl4). GPU tensors are staged through
host memory (pinned on CUDA hosts) and reads land in host memory.

Mooncake listens on all interfaces and has no authentication: whoever reaches its ports can
read the buffers a sender registered (only those: the engine checks addresses). Its own log
level defaults to WARNING here (``MC_LOG_LEVEL`` overrides); this module logs one INFO line
when the engine starts, naming its protocol and session.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import queue
import socket
import threading

import torch

from mstar import wire
from mstar.env import settings
from mstar.services.transport.base import MIN_REF_BYTES, TensorSender
from mstar.v1 import tensor_pb2 as pb

log = logging.getLogger(__name__)

METADATA = "P2PHANDSHAKE"  # Mooncake's metadata "server" for direct peer-to-peer handshakes
SLOT_MIN_BYTES = 64 * 1024  # smallest size class
ARENA_MIN_BYTES = 8 << 20  # smallest region registered at once (small classes share one)
READ_CHUNK_BYTES = 64 << 20  # a receiver reads bigger tensors in pieces of this size (bounded staging)
READ_TIMEOUT_S: float | None = None  # per read, plus size / READ_MIN_RATE; None: MSTAR_CONNECT_TIMEOUT_S
READ_MIN_RATE = 10e6  # bytes/s a healthy link beats by far; only stretches the deadline of big reads
PROTOCOLS = ("auto", "rdma", "tcp")
_RDMA_SYSFS = "/sys/class/infiniband"
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


class MooncakeError(RuntimeError):
    """The Mooncake engine could not start, register memory or move bytes."""


class ReadTimedOut(MooncakeError):
    """A read did not finish in time; its native call may still write the local buffer."""


@functools.cache
def _import_error() -> str:
    _engine_env_defaults()  # Mooncake reads its log level once, as the module loads
    try:
        import mooncake.engine  # noqa: F401
    except Exception as e:  # ImportError, or a missing libibverbs
        return f"{type(e).__name__}: {e}"
    return ""


def available() -> bool:
    return _import_error() == ""


def unavailable_reason() -> str:
    return (f"cannot import mooncake.engine ({_import_error()}); install mooncake-transfer-engine (CUDA hosts) or "
            "mooncake-transfer-engine-non-cuda plus libibverbs1")


def rdma_devices() -> list[str]:
    """RDMA devices of this host (what ibverbs lists), from sysfs."""
    try:
        return sorted(os.listdir(_RDMA_SYSFS))
    except OSError:
        return []


def _not_local(host: str) -> str:
    """Why ``host`` is not an address this host can bind; "" when it is."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"cannot resolve {host}: {e}"
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
                return ""
            except OSError:
                continue
    return f"{host} is not an address of this host"


def _outward_ip() -> str:
    """This host's address on its default route (no packet is sent); 127.0.0.1 without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only selects a route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# ---------------------------------------------------------------------------------------
# the process-wide engine


class Engine:
    """This process's Mooncake transfer engine (``te``), its session and its registrations."""

    def __init__(self, host: str, protocol: str, configured: bool):
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        rc = self.te.initialize(host, METADATA, protocol, "")
        if rc != 0:
            ports = f"{os.environ.get('MC_MIN_RPC_PORT', '15000')}-{os.environ.get('MC_MAX_RPC_PORT', '17000')}"
            raise MooncakeError(f"Mooncake transfer engine failed to start on {host} ({protocol}, {METADATA}): "
                                f"initialize returned {rc}; is {host} an address of this host, and is a port of "
                                f"{ports} (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, --mooncake-port) free?")
        self.host, self.protocol, self.configured, self.pid = host, protocol, configured, os.getpid()
        self.session = f"{host}:{self.te.get_rpc_port()}"
        self.registered: dict[int, int] = {}  # address -> bytes
        self._stuck: dict[str, int] = {}  # session -> reads given up on whose native call still runs
        self._lock = threading.Lock()

    def register(self, addr: int, nbytes: int) -> None:
        rc = self.te.register_memory(addr, nbytes)
        if rc != 0:
            raise MooncakeError(f"Mooncake could not register {nbytes} B at {addr:#x} ({self.protocol}): code {rc}")
        with self._lock:
            self.registered[addr] = nbytes

    def unregister(self, addr: int) -> None:
        with self._lock:
            if self.registered.pop(addr, None) is None:
                return
        rc = self.te.unregister_memory(addr)
        if rc != 0:
            log.warning("mooncake: unregistering %#x failed (code %d)", addr, rc)

    def read(self, session: str, local: int, remote: int, nbytes: int, on_late_return=None) -> None:
        """One-sided read of ``nbytes`` at ``remote`` in ``session`` into registered ``local``.

        Raises ``MooncakeError`` naming the session when the read fails, and when it has not
        finished within ``read_timeout_s(nbytes)``: the native call cannot be cancelled, so it
        goes on in a worker thread and ``on_late_return()`` runs once it returns (until then
        ``local`` must stay allocated and untouched), and reads from that session fail at once.
        """
        with self._lock:
            if self._stuck.get(session):
                raise MooncakeError(f"Mooncake session {session} does not answer: an earlier read from it has not "
                                    "returned yet")
        done = threading.Event()
        box: dict = {}

        def call() -> None:
            try:
                box["rc"] = self.te.transfer_sync_read(session, local, remote, nbytes)
            except BaseException as e:  # noqa: B036 - handed to the waiting thread
                box["error"] = e
            with self._lock:
                done.set()
                late = box.get("abandoned", False)
                if late:
                    self._stuck[session] -= 1
            if late and on_late_return is not None:
                on_late_return()

        timeout = read_timeout_s(nbytes)
        _run_in_worker(call)
        if not done.wait(timeout):
            with self._lock:
                if not done.is_set():
                    box["abandoned"] = True
                    self._stuck[session] = self._stuck.get(session, 0) + 1
                    raise ReadTimedOut(f"Mooncake read of {nbytes} B from session {session} did not finish within "
                                        f"{timeout:.1f} s: the sending service is stuck or unreachable over "
                                        f"{self.protocol}")
        if "error" in box:
            e = box["error"]
            raise MooncakeError(f"Mooncake read of {nbytes} B from session {session} failed: {e}") from e
        if box["rc"] != 0:
            raise MooncakeError(f"Mooncake read of {nbytes} B at {remote:#x} from session {session} failed "
                                f"(code {box['rc']}): the sending service is gone, unreachable over {self.protocol}, "
                                "or no longer holds that buffer")


def read_timeout_s(nbytes: int) -> float:
    """How long a read may take before the receiver gives up on the sender."""
    base = READ_TIMEOUT_S if READ_TIMEOUT_S is not None else settings().connect_timeout_s
    return base + nbytes / READ_MIN_RATE


def _engine_env_defaults() -> None:
    """Mooncake reads its settings from the environment; fill in ours where none is set."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    # a peer that accepts but stays silent fails a read in about the time M* waits for any
    # peer (Mooncake's defaults are 30 s); these bound the wait for a status frame or any
    # progress and the handshake's connect(), never a transfer that is moving
    secs = str(max(1, math.ceil(settings().connect_timeout_s)))
    for name in ("MC_TCP_STATUS_TIMEOUT_SEC", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_HANDSHAKE_CONNECT_TIMEOUT"):
        os.environ.setdefault(name, secs)


# Blocking engine calls run on daemon threads so that a caller can stop waiting for a
# peer that never answers (the handshake's receive timeout is fixed at 60 s in the
# engine). Every call gets a free thread: a stuck call never delays another one.
_jobs: queue.SimpleQueue = queue.SimpleQueue()
_idle = 0
_idle_lock = threading.Lock()


def _worker() -> None:
    global _idle
    while True:
        job = _jobs.get()
        try:
            job()
        except BaseException:  # noqa: B036 - a worker must survive its job
            log.exception("mooncake worker job failed")
        with _idle_lock:
            _idle += 1


def _run_in_worker(job) -> None:
    global _idle
    with _idle_lock:
        spawn = _idle == 0
        if not spawn:
            _idle -= 1  # reserved for this job
    if spawn:
        threading.Thread(target=_worker, name="mooncake-call", daemon=True).start()
    _jobs.put(job)


def _after_fork_in_child() -> None:  # the parent's worker threads do not exist here
    global _jobs, _idle, _idle_lock
    _jobs, _idle, _idle_lock = queue.SimpleQueue(), 0, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)

_lock = threading.Lock()
_config: tuple[str, str] | None = None  # (host, protocol) from configure()
_engine: Engine | None = None


def _resolve_protocol(protocol: str) -> str:
    p = (protocol or "auto").lower()
    if p not in PROTOCOLS:
        raise ValueError(f"Mooncake protocol must be one of {', '.join(PROTOCOLS)}; got '{protocol}'")
    devices = rdma_devices()
    if p == "rdma" and not devices:
        raise MooncakeError(f"Mooncake protocol 'rdma' was asked for but this host has no RDMA devices "
                            f"({_RDMA_SYSFS} is empty or missing); use 'tcp' or 'auto'")
    if p == "auto":
        p = "rdma" if devices else "tcp"
    return p


def configure(local_host: str, protocol: str = "auto") -> None:
    """Set the address peers reach this process on and the protocol; starts nothing.

    ``local_host`` is a host name or IP without a port (the address the service serves on);
    a wildcard (``0.0.0.0``) stands for this host's address on its default route.
    ``protocol``: ``auto`` (``rdma`` where RDMA devices exist, ``tcp`` otherwise), ``rdma``
    (raises without devices) or ``tcp``. Call it before the engine is first used; calling
    it again with the same settings is harmless, with others once the engine runs raises.
    """
    global _config
    host = local_host.strip()
    if host in _WILDCARDS:
        host = _outward_ip()
        log.info("mooncake: %r is a wildcard; peers will reach this process on %s", local_host, host)
    proto = _resolve_protocol(protocol)
    problem = _not_local(host)
    if problem:
        log.warning("mooncake: %s; readers must still reach this process there (through NAT, say), or reads "
                    "from it will fail", problem)
    with _lock:
        e = _engine if _engine is not None and _engine.pid == os.getpid() else None
        if e is not None and (e.host, e.protocol) != (host, proto):
            raise MooncakeError(f"the Mooncake engine already runs as {e.session} over {e.protocol}; "
                                f"configure({host!r}, {proto!r}) must come before its first use")
        _config = (host, proto)


def engine() -> Engine:
    """The process-wide engine, started on first use (INFO log: protocol and session)."""
    global _engine
    e = _engine
    if e is not None and e.pid == os.getpid():
        return e
    if not available():
        raise MooncakeError(unavailable_reason())
    with _lock:
        if _engine is None or _engine.pid != os.getpid():  # a forked child needs its own
            host, proto = _config if _config is not None else ("127.0.0.1", _resolve_protocol("auto"))
            _engine = Engine(host, proto, configured=_config is not None)
            note = "" if _engine.configured else " (loopback only: configure() was not called)"
            log.info("mooncake transfer engine up: protocol %s, session %s%s", proto, _engine.session, note)
        return _engine


def running() -> Engine | None:
    """The engine if this process started it (it advertised a session to its peers), else None."""
    e = _engine
    return e if e is not None and e.pid == os.getpid() else None


def advertise() -> tuple[str, str]:
    """(session, protocol) this process offers to senders; ("", "") without Mooncake.

    Starts the engine when ``configure()`` was called; offers nothing otherwise (see the
    module docstring), or when the engine cannot start (logged; links then stay inline).
    """
    if not available() or _config is None:
        return "", ""
    try:
        e = engine()
    except MooncakeError as err:
        log.warning("mooncake: not offered to senders: %s", err)
        return "", ""
    return e.session, e.protocol


# ---------------------------------------------------------------------------------------
# pooled registered memory


def size_class(nbytes: int) -> int:
    size = SLOT_MIN_BYTES
    while size < nbytes:
        size *= 2
    return size


class _Slot:
    __slots__ = ("size", "addr", "view")

    def __init__(self, size: int, addr: int, view: torch.Tensor):
        self.size, self.addr, self.view = size, addr, view


class _Pool:
    """Registered host memory in arenas of equal slots; a slot holds one tensor at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arenas: list[tuple[Engine, torch.Tensor]] = []
        self._slots: dict[int, _Slot] = {}
        self._free: dict[int, list[int]] = {}  # size class -> slot ids
        self._busy: set[int] = set()
        self._next_id = 1
        self.registrations = 0  # arenas registered so far (for tests and metrics)

    def acquire(self, nbytes: int) -> tuple[int, _Slot]:
        size = size_class(nbytes)
        with self._lock:
            free = self._free.setdefault(size, [])
            if not free:
                self._grow(size, free)
            slot_id = free.pop()
            self._busy.add(slot_id)
            return slot_id, self._slots[slot_id]

    def _grow(self, size: int, free: list[int]) -> None:
        eng = engine()
        count = max(1, ARENA_MIN_BYTES // size)
        pin = torch.cuda.is_available()  # pinned: faster device-to-host staging on GPU hosts
        arena = torch.empty(count * size, dtype=torch.uint8, pin_memory=pin)
        base = arena.data_ptr()
        eng.register(base, count * size)
        self._arenas.append((eng, arena))
        self.registrations += 1
        for i in range(count):
            slot_id, self._next_id = self._next_id, self._next_id + 1
            self._slots[slot_id] = _Slot(size, base + i * size, arena[i * size : (i + 1) * size])
            free.append(slot_id)
        free.reverse()  # hand out the arena's slots in address order

    def release(self, slot_ids) -> None:
        with self._lock:
            for slot_id in slot_ids:
                if slot_id in self._busy:  # unknown or already free: ignore (a late or repeated ack)
                    self._busy.discard(slot_id)
                    self._free[self._slots[slot_id].size].append(slot_id)

    def is_free(self, slot_id: int) -> bool:
        with self._lock:
            return slot_id in self._slots and slot_id not in self._busy

    def close(self) -> None:
        with self._lock:
            arenas, self._arenas = self._arenas, []
            self._slots.clear()
            self._free.clear()
            self._busy.clear()
        for eng, arena in arenas:
            eng.unregister(arena.data_ptr())

    @property
    def registered_addresses(self) -> list[int]:
        with self._lock:
            return [arena.data_ptr() for _, arena in self._arenas]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (contiguous copy only when needed; may stay on GPU)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------------------
# sender and reader


class MooncakeSender(TensorSender):
    """Registered slots for one outgoing link; a slot is reused once the receiver acks it."""

    def __init__(self, owner: str):
        self.owner = owner
        self._pool = _Pool()

    def encode_into(self, msg: pb.Tensor, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if n < MIN_REF_BYTES:  # a reference costs more than the copy
            wire.fill_proto(msg, name, t)
            return
        datatype = wire.wire_dtype(t.dtype)
        session = engine().session
        slot_id, slot = self._pool.acquire(n)
        try:
            slot.view[:n].copy_(_byte_view(t))
        except BaseException:
            self._pool.release([slot_id])
            raise
        msg.name, msg.datatype = name, datatype
        msg.shape.extend(t.shape)
        ref = msg.mooncake
        ref.session, ref.address, ref.nbytes, ref.buffer_id = session, slot.addr, n, slot_id

    def release(self, buffer_ids) -> None:
        self._pool.release(buffer_ids)

    def close(self) -> None:
        self._pool.close()

    @property
    def registrations(self) -> int:
        return self._pool.registrations

    def is_free(self, buffer_id: int) -> bool:
        return self._pool.is_free(buffer_id)

    @property
    def registered_addresses(self) -> list[int]:
        return self._pool.registered_addresses


class MooncakeReader:
    """Reads tensors named by incoming MooncakeRefs through registered staging slots."""

    def __init__(self) -> None:
        self._pool = _Pool()

    def read(self, msg: pb.Tensor, acks: list[int]) -> torch.Tensor:
        ref = msg.mooncake
        try:
            dtype = wire.torch_dtype(msg.datatype)
            n = math.prod(msg.shape) * torch.empty((), dtype=dtype).element_size()
            if n != ref.nbytes or min(msg.shape, default=0) < 0:
                raise wire.WireError(f"tensor '{msg.name}' of shape {list(msg.shape)} {msg.datatype} needs {n} bytes, "
                                     f"the Mooncake ref from session {ref.session} names {ref.nbytes}")
            eng = running()
            if eng is None:  # a frame never starts a transport engine (nor its listeners)
                raise wire.WireError(f"tensor '{msg.name}': a Mooncake ref from session {ref.session}, but this service "
                                     f"offers no Mooncake session (it did not advertise one); refused")
            out = torch.empty(list(msg.shape), dtype=dtype)
            if n == 0:
                return out
            dst = out.view(-1).view(torch.uint8)
            slot_id, slot = self._pool.acquire(min(n, READ_CHUNK_BYTES))
            give_back = True
            try:
                for off in range(0, n, READ_CHUNK_BYTES):
                    k = min(READ_CHUNK_BYTES, n - off)
                    try:  # the closure keeps the slot's memory alive for a late native return
                        eng.read(ref.session, slot.addr, ref.address + off, k,
                                 on_late_return=lambda s=slot: self._pool.release([slot_id]))
                    except ReadTimedOut:
                        give_back = False  # still the native call's; freed when it returns
                        raise
                    dst[off : off + k].copy_(slot.view[:k])
            finally:
                if give_back:
                    self._pool.release([slot_id])
            return out
        finally:
            acks.append(ref.buffer_id)

    def close(self) -> None:
        self._pool.close()

    @property
    def registrations(self) -> int:
        return self._pool.registrations
