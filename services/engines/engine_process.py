"""A KV-cache engine in a child process of the node-group service.

In the service's own process the engine's stepping thread and the event loop (frame
routing, per-token walk bookkeeping) share one GIL: at high concurrency each waits on
the other and the GPU idles between steps. ``EngineProcess`` runs the engine in a
process of its own that steps back to back for as long as it has sequences, and sends
each step's sampled tokens up a pipe; the service keeps only the bookkeeping.

It offers the part of ``KVCacheEngine`` that scheduled generation uses (``add_request``,
``step``, ``has_work``, ``release``, ``close``, page counts), so an engine node can hold
either. ``step`` here waits for the next batch of events from the child (the GIL is free
while it waits) and returns everything that arrived meanwhile.

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
import threading
import traceback
from collections.abc import Callable, Sequence

from mstar.services.engines.kv_engine import KVCacheEngine, StepFailed
from mstar.services.engines.sampling import SamplingParams
from mstar.services.engines.scheduler import SeqEvent
from mstar.services.engines.sequence import SeqStatus

log = logging.getLogger(__name__)
PIPE_BYTES = 1 << 20  # a service busy routing lets ~1 MiB of events queue before the child waits
POLL_S = 0.05  # how often a waiting ``step`` checks that the child is alive and still has work
_F_SETPIPE_SZ = 1031


class EngineProcessDied(RuntimeError):
    pass


class EngineProcess:
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
        self._pages = ctx.RawArray("q", 2)  # (used, free): the child writes them after every step and command
        self.proc = ctx.Process(target=_child, args=(name, factory, args, cmd_r, ev_w, self._pages, level),
                                name=f"engine-{name}", daemon=True)
        self.proc.start()
        cmd_r.close()
        ev_w.close()
        self._send_lock = threading.Lock()  # submits come from the engine thread, releases from the loop
        self._live: set[str] = set()  # added and neither finished nor released
        self._dead: str | None = None
        self.steps = 0
        kind, *rest = self._recv_blocking()
        if kind == "error":
            self.proc.join(5)
            raise RuntimeError(f"engine process '{name}' failed to start:\n{rest[0]}")
        assert kind == "ready", kind
        self.info = rest[0]

    # -- the KVCacheEngine surface ---------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    key: tuple[str, str] = ("", ""), timeout_s: float | None = None) -> None:
        self._send(("add", request_id, list(prompt_ids), params, key, timeout_s))
        self._live.add(request_id)

    def release(self, request_id: str) -> None:
        self._live.discard(request_id)
        if self._dead is None:
            try:
                self._send(("release", request_id))
            except EngineProcessDied:
                pass  # nothing left to free

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    @property
    def pages(self) -> tuple[int, int]:
        """(used, free) KV pages in the child, as of its last step or command."""
        return self._pages[0], self._pages[1]

    def step(self) -> list[SeqEvent]:
        """The events of the child's next step(s): waits until a message arrives (or nothing
        is left to wait for: every request was released meanwhile), then takes all that came."""
        out: list[SeqEvent] = []
        msg = self._recv_blocking(while_live=True)
        while msg is not None:
            failed = self._apply(msg, out)
            if failed is not None:
                raise failed
            msg = self._events.recv() if self._events.poll() else None
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        if self._dead is None and self.proc.is_alive():
            try:
                self._send(("close",))
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

    # -- plumbing ------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        if self._dead is not None:
            raise EngineProcessDied(self._dead)
        try:
            with self._send_lock:
                self._cmds.send(msg)
        except (BrokenPipeError, OSError):
            raise self._died() from None

    def _recv_blocking(self, while_live: bool = False) -> tuple | None:
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

    def _apply(self, msg: tuple, out: list[SeqEvent]) -> Exception | None:
        kind = msg[0]
        if kind == "events":
            _, events = msg
            self.steps += 1
            for rid, token, status in events:
                if rid not in self._live:
                    continue  # released meanwhile
                st = SeqStatus(status)
                if st.finished:
                    self._live.discard(rid)
                out.append(SeqEvent(rid, token, st))
            return None
        if kind == "rejected":  # add_request raised in the child: that request id alone ends
            _, rid, why = msg
            if rid in self._live:
                self._live.discard(rid)
                log.error("engine process '%s' refused request %s: %s", self.name, rid, why)
                out.append(SeqEvent(rid, None, SeqStatus.FINISHED_ABORTED))
            return None
        if kind == "failed":  # a step raised: its requests were released in the child
            _, rids, why = msg
            self._live.difference_update(rids)
            err = StepFailed(rids)
            err.__cause__ = RuntimeError(why)
            return err
        raise AssertionError(f"engine process '{self.name}' sent {kind!r}")


def _widen(conn) -> None:
    try:
        fcntl.fcntl(conn.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size: the default size still works


def _child(name: str, factory: Callable[..., KVCacheEngine], args: tuple, cmds, events, pages, level: int) -> None:
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s [engine:{name}] %(name)s: %(message)s")
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    try:
        engine = factory(*args)
    except BaseException:
        events.send(("error", traceback.format_exc()))
        return
    alloc = engine.cache.allocator

    def count_pages() -> None:
        pages[0], pages[1] = alloc.num_used, alloc.num_free

    count_pages()
    events.send(("ready", {"pid": os.getpid(), "cuda_graphs": engine.cuda_graphs}))
    try:
        _serve(engine, cmds, events, count_pages)
    except (EOFError, BrokenPipeError):
        pass  # the service is gone
    finally:
        try:
            engine.close()
        except Exception:
            log.exception("closing the engine failed")


def _serve(engine: KVCacheEngine, cmds, events, count_pages: Callable[[], None]) -> None:
    while True:
        # idle: wait for a command; busy: take what has arrived, then step
        while not engine.has_work or cmds.poll():
            msg = cmds.recv()
            if msg[0] == "close":
                return
            _command(engine, msg, events)
            count_pages()
        try:
            evs = engine.step()
        except StepFailed as e:
            events.send(("failed", e.request_ids, f"{type(e.__cause__).__name__}: {e.__cause__}"))
            continue
        finally:
            count_pages()
        if evs:
            events.send(("events", [(ev.request_id, ev.token_id, int(ev.status)) for ev in evs]))


def _command(engine: KVCacheEngine, msg: tuple, events) -> None:
    kind = msg[0]
    if kind == "add":
        _, rid, prompt, params, key, timeout_s = msg
        try:
            engine.add_request(rid, prompt, params, key=key, timeout_s=timeout_s)
        except Exception as e:
            # the id ends here, whatever it already held (a duplicate id's first sequence
            # too): no event of it follows the refusal, and none of its pages stay taken
            engine.release(rid)
            events.send(("rejected", rid, f"{type(e).__name__}: {e}"))
    elif kind == "release":
        engine.release(msg[1])
    else:
        raise AssertionError(f"unknown engine command {kind!r}")

