"""A KV-cache engine in a child process of the node-group service.

In the service's own process the engine's stepping thread and the event loop (frame
routing, per-token walk bookkeeping) share one GIL: at high concurrency each waits on
the other and the GPU idles between steps. ``EngineProcess`` runs the engine in a
process of its own that steps back to back for as long as it has sequences, and sends
each step's outputs up a pipe; the service keeps only the bookkeeping.

It offers the sequence-engine surface of ``LocalSeqEngine`` (seq_engine.py: ``submit``,
``step``, ``has_work``, ``release``, ``close``, ``kv_stats``), so an engine node can hold
either; the child runs a ``LocalSeqEngine``. ``step`` here waits for the next batch of
outputs from the child (the GIL is free while it waits) and returns everything that
arrived meanwhile. The two ends speak the typed messages below.

Lifetimes: the child exits when the service closes it, when the command pipe reaches EOF
(the service died) or, on Linux, when its parent dies (PR_SET_PDEATHSIG). A child that
dies fails the calls in it and every later one with a message naming it; ``exit_reason``
tells the service to stop (it cannot serve that node any more).
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace

from mstar import nvtx
from mstar.metrics import KvStats
from mstar.models.engine import Engine
from mstar.services.engines.kv_engine import KVCacheEngine, StepFailed
from mstar.services.engines.seq_engine import ImportSeq, LocalSeqEngine, SeqOutput, SeqWork

log = logging.getLogger(__name__)
PIPE_BYTES = 1 << 20  # a service busy routing lets ~1 MiB of outputs queue before the child waits
POLL_S = 0.05  # how often a waiting ``step`` checks that the child is alive and still has work
_F_SETPIPE_SZ = 1031


# -- service -> child ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    request_id: str
    work: SeqWork


@dataclass(frozen=True)
class Release:
    request_id: str


@dataclass(frozen=True)
class Close:
    pass


# -- child -> service ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    pid: int
    cuda_graphs: bool


@dataclass(frozen=True)
class StartFailed:
    traceback: str


@dataclass(frozen=True)
class Outputs:
    """One step's outputs (refusals of submitted work included)."""

    outputs: list[SeqOutput]


@dataclass(frozen=True)
class Failed:
    """A step raised; its requests were released in the child."""

    request_ids: list[str]
    why: str


class EngineProcessDied(RuntimeError):
    pass


class EngineProcess(Engine[SeqWork]):
    def __init__(self, name: str, factory: Callable[..., KVCacheEngine], args: tuple = (), log_level: int | None = None):
        """Start the child and wait until ``factory(*args)`` built its engine there (raises
        with the child's traceback if it failed). ``factory`` must be importable by name."""
        self.name = name
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state or threads inherited
        cmd_r, self._cmds = ctx.Pipe(duplex=False)
        self._events, ev_w = ctx.Pipe(duplex=False)
        for conn in (cmd_r, ev_w):
            _widen(conn)
        level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        self._stats = ctx.RawArray("q", 3)  # (pages used, free, preemptions): the child writes them after every step
        self.proc = ctx.Process(target=_child, args=(name, factory, args, cmd_r, ev_w, self._stats, level),
                                name=f"engine-{name}", daemon=True)
        self.proc.start()
        cmd_r.close()
        ev_w.close()
        self._live: set[str] = set()  # submitted and neither finished nor released
        self._dead: str | None = None
        self.steps = 0
        msg = self._recv_blocking()
        if isinstance(msg, StartFailed):
            self.proc.join(5)
            raise RuntimeError(f"engine process '{name}' failed to start:\n{msg.traceback}")
        assert isinstance(msg, Started), msg
        self.info = msg

    # -- the sequence-engine surface -----------------------------------------------------------
    def submit(self, request_id: str, work: SeqWork) -> None:
        if isinstance(work, ImportSeq) and work.kv.device.type != "cpu":  # see _kv_to_host
            work = replace(work, kv=work.kv.cpu())
        self._send(Submit(request_id, work))
        self._live.add(request_id)

    def release(self, request_id: str) -> None:
        self._live.discard(request_id)
        if self._dead is None:
            try:
                self._send(Release(request_id))
            except EngineProcessDied:
                pass  # nothing left to free

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    def kv_stats(self) -> KvStats:
        """As of the child's last step or command."""
        return KvStats(*self._stats)

    def step(self) -> list[SeqOutput]:
        """The outputs of the child's next step(s): waits until a message arrives (or nothing
        is left to wait for: every request was released meanwhile), then takes all that came."""
        out: list[SeqOutput] = []
        msg = self._recv_blocking(while_live=True)
        while msg is not None:
            self._apply(msg, out)
            msg = self._events.recv() if self._events.poll() else None
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        if self._dead is None and self.proc.is_alive():
            try:
                self._send(Close())
            except EngineProcessDied:
                pass
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            log.warning("engine process '%s' did not stop in %g s; killing it", self.name, timeout_s)
            self.proc.kill()
            self.proc.join(5)
        self._dead = self._dead or "closed"
        self._cmds.close()
        self._events.close()

    def exit_reason(self) -> str | None:
        """Why the child is gone (it exited or was killed) while still needed, else None."""
        if self._dead is None and not self.proc.is_alive():
            self._died()
        return None if self._dead == "closed" else self._dead

    def follow(self) -> None:
        raise TypeError("an engine process does not run tensor-parallel")

    # -- plumbing ------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        if self._dead is not None:
            raise EngineProcessDied(self._dead)
        try:
            self._cmds.send(msg)
        except (BrokenPipeError, OSError):
            raise self._died() from None

    def _recv_blocking(self, while_live: bool = False):
        """The next message; None once ``while_live`` and no request is left in the engine."""
        while self._dead is None:
            if self._events.poll(POLL_S):
                try:
                    return self._events.recv()
                except (EOFError, OSError):
                    break
            if not self.proc.is_alive():
                break
            if while_live and not self._live:
                return None
        raise self._died()

    def _died(self) -> EngineProcessDied:
        if self._dead is None or self._dead == "closed":
            self.proc.join(1)
            code = self.proc.exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            self._dead = f"the engine process of node '{self.name}' (pid {self.proc.pid}) {how}"
            log.error("%s", self._dead)
            self._live.clear()
        return EngineProcessDied(self._dead)

    def _apply(self, msg, out: list[SeqOutput]) -> None:
        if isinstance(msg, Outputs):
            self.steps += 1
            for o in msg.outputs:
                if o.request_id not in self._live:
                    continue  # released meanwhile
                if o.finished:
                    self._live.discard(o.request_id)
                out.append(o)
        elif isinstance(msg, Failed):
            self._live.difference_update(msg.request_ids)
            err = StepFailed(msg.request_ids)
            err.__cause__ = RuntimeError(msg.why)
            raise err
        else:
            raise AssertionError(f"engine process '{self.name}' sent {msg!r}")


def _widen(conn) -> None:
    try:
        fcntl.fcntl(conn.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size: the default size still works


def _child(name: str, factory: Callable[..., KVCacheEngine], args: tuple, cmds, events, stats, level: int) -> None:
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s [engine:{name}] %(name)s: %(message)s")
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    nvtx.from_settings()
    try:
        engine = LocalSeqEngine(factory(*args))
    except BaseException:
        events.send(StartFailed(traceback.format_exc()))
        return

    def count() -> None:
        s = engine.kv_stats()
        stats[0], stats[1], stats[2] = s.pages_used, s.pages_free, s.preemptions

    count()
    events.send(Started(os.getpid(), engine.engine.cuda_graphs))
    try:
        _serve(engine, cmds, events, count)
    except (EOFError, BrokenPipeError):
        pass  # the service is gone
    finally:
        try:
            engine.close()
        except Exception:
            log.exception("closing the engine failed")


def _serve(engine: LocalSeqEngine, cmds, events, count: Callable[[], None]) -> None:
    while True:
        # idle: wait for a command; busy: take what has arrived, then step
        while not engine.has_work or cmds.poll():
            msg = cmds.recv()
            if isinstance(msg, Close):
                return
            if isinstance(msg, Submit):
                engine.submit(msg.request_id, msg.work)
            elif isinstance(msg, Release):
                engine.release(msg.request_id)
            else:
                raise AssertionError(f"unknown engine command {msg!r}")
            count()
        try:
            with nvtx.span("engine step") if nvtx.ACTIVE else nvtx.NULL:
                outs = engine.step()
        except StepFailed as e:
            events.send(Failed(e.request_ids, f"{type(e.__cause__).__name__}: {e.__cause__}"))
            continue
        finally:
            count()
        if outs:
            events.send(Outputs([_kv_to_host(o) for o in outs]))


def _kv_to_host(o: SeqOutput) -> SeqOutput:
    """A hand-off's K/V crosses the pipe as a host tensor (pickled); CUDA tensors would need
    the receiver to map the child's memory while the child keeps it alive."""
    if o.kv is None or o.kv.device.type == "cpu":
        return o
    return o._replace(kv=o.kv.cpu())
