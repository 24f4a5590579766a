"""Worker processes that parse large JSON bodies (json_bounds.parse), off the gateway's event loop.

json.loads holds the GIL for its whole run, so a thread would stall the loop as much as parsing on
it: 29 MiB of one-character chat messages held it 3.2 s. A worker is a fresh interpreter
(``python -m mstar.gateway.json_worker``, started on first use, never forked from this asyncio +
gRPC process: subprocess execs it without running fork handlers, as the launcher starts services)
that runs one parse at a time at a lower CPU priority than serving. A body goes over a socket
pair as bytes; the shaped document (or a Refused) comes back pickled, from our own child. The
exchange runs on one of ``JSON_WORKERS`` threads (the GIL is free while it waits), so at most that
many parses run and the rest queue there.

A worker hands its memory back to the OS after each parse (json_worker.py); one still above
``JSON_WORKER_MAX_RSS`` when next taken is replaced, and so is one that dies or passes
``JSON_PARSE_TIMEOUT_S`` (that request: 503); one idle for ``JSON_WORKER_IDLE_S`` is stopped. Workers die with the gateway (PR_SET_PDEATHSIG via
mstar.lifetime, and their socket closes). The death signal follows the thread that started the
worker: the pool's threads live as long as the pool.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from mstar import lifetime
from mstar.gateway.errors import ApiError
from mstar.limits import JSON_PARSE_TIMEOUT_S, JSON_WORKER_IDLE_S, JSON_WORKER_MAX_RSS, JSON_WORKERS

log = logging.getLogger("mstar.gateway")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _Worker:
    def __init__(self):
        self.conn, child = multiprocessing.Pipe(duplex=True)
        # the parent's sys.path, so that the worker imports the same mstar as this process
        env = {**os.environ, **lifetime.child_env(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "mstar.gateway.json_worker", str(child.fileno())],
                                     pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        child.close()
        #: when it last finished a parse (time.monotonic())
        self.idle_since = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exchange(self, raw: bytes | bytearray, shape: str, timeout_s: float) -> object:
        self.conn.send_bytes(shape.encode())
        self.conn.send_bytes(raw)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"no answer in {timeout_s:g} s")
        return pickle.loads(self.conn.recv_bytes())

    def stop(self) -> None:
        self.conn.close()  # the worker reads EOF and exits
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(2.0)


class JsonPool:
    def __init__(self, workers: int = JSON_WORKERS, max_rss: int = JSON_WORKER_MAX_RSS,
                 timeout_s: float = JSON_PARSE_TIMEOUT_S, idle_s: float = JSON_WORKER_IDLE_S):
        self.max_rss, self.timeout_s, self.idle_s = max_rss, timeout_s, idle_s
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="gateway-json")
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        #: workers replaced for their memory
        self.recycled = 0

    def parse(self, raw: bytes | bytearray, shape: str) -> asyncio.Future:
        """json_bounds.parse(raw, shape) in a worker: a future of its result. It runs to its end even
        if the caller stops waiting (its worker goes back to the pool then), so hold what it costs
        (the caller's turn, json_fair.py) until the future is done."""
        return asyncio.get_running_loop().run_in_executor(self._threads, self._run, raw, shape)

    def _run(self, raw: bytes | bytearray, shape: str) -> object:
        worker = self._take()
        try:
            result = worker.exchange(raw, shape, self.timeout_s)
        except (OSError, EOFError, TimeoutError, pickle.UnpicklingError) as e:
            log.error("JSON worker %d failed on a %d-byte body (%s); replacing it", worker.pid, len(raw), e)
            worker.stop()
            raise ApiError(503, "the gateway's JSON worker failed on this body; the gateway log says why",
                           code="UNAVAILABLE") from None
        worker.idle_since = time.monotonic()
        with self._lock:
            self._idle.append(worker)
        return result

    def _take(self) -> _Worker:
        while True:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                return _Worker()
            if worker.proc.poll() is None and rss_bytes(worker.pid) <= self.max_rss:
                return worker
            self.recycled += 1
            worker.stop()

    def retire_idle(self) -> int:
        """Stop the workers idle for ``idle_s`` or more (blocking: call it on a thread); how many."""
        now = time.monotonic()
        with self._lock:
            old = [w for w in self._idle if now - w.idle_since >= self.idle_s]
            self._idle = [w for w in self._idle if w not in old]
        for w in old:
            w.stop()
        return len(old)

    def pids(self) -> list[int]:
        """The idle workers' (all of them, between requests)."""
        with self._lock:
            return [w.pid for w in self._idle]

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.stop()
