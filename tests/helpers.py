"""Shared test helpers (importable as `helpers`: tests/ is on sys.path)."""

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import grpc
import pytest

from mstar.models.base import Model, NodeSubmodule, Output, RequestState
from mstar.models.graph import Modality
from mstar.v1 import conductor_pb2 as cpb


def run(coro, timeout: float = 60):
    """Run a coroutine with a hard timeout (pytest-asyncio is not used)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def started_mesh(make_mesh, tries: int | None = None):
    """``make_mesh()`` (a launcher ``Mesh``), started. A port chosen free can be taken by a test
    running beside this one before its service binds it (PortTaken): the start is then made again on
    a new Mesh, with ports chosen again, as ``mstar serve`` does (``launcher.run_forever``)."""
    from mstar.launcher import START_TRIES, PortTaken

    for _ in range((tries or START_TRIES) - 1):
        mesh = make_mesh()
        try:
            mesh.start()  # a failed start stops what it started
            return mesh
        except PortTaken:
            pass
    mesh = make_mesh()
    mesh.start()  # the last try: its PortTaken is the test's
    return mesh


def request(text: str, request_id: str = "", timeout_s: float = 0, **kwargs) -> cpb.GenerateRequest:
    return cpb.GenerateRequest(model="toy", text=text, model_kwargs_json=json.dumps(kwargs),
                               request_id=request_id, timeout_s=timeout_s)


async def collect(stub, req, timeout: float = 20):
    """All chunks by name, and the final event; raises grpc.aio.AioRpcError on failure."""
    out: dict[str, list] = {}
    final = None
    async for r in stub.Generate(req, timeout=timeout):
        for c in r.chunks:
            out.setdefault(c.name, []).append(c)
        if r.HasField("final"):
            final = r.final
    return out, final


def text_of(chunks) -> str:
    return "".join(c.text for c in chunks)


def rot13(s: str) -> str:
    return s.translate(str.maketrans(
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "nopqrstuvwxyzabcdefghijklmNOPQRSTUVWXYZABCDEFGHIJKLM"))


__all__ = ["run", "request", "collect", "text_of", "rot13", "grpc"]


async def wait_released(mesh, timeout=5.0, dead=()):
    """Every live node group and the conductor hold nothing for any request."""
    deadline = asyncio.get_running_loop().time() + timeout
    live = [s for g, s in mesh.groups.items() if g not in dead]
    while asyncio.get_running_loop().time() < deadline:
        if not mesh.conductor.table.active and all(not s.runtime.requests for s in live):
            return
        await asyncio.sleep(0.02)
    held = {g: list(s.runtime.requests) for g, s in mesh.groups.items()}
    raise AssertionError(f"requests still held: conductor={list(mesh.conductor.table.active)} groups={held}")


async def cancel_and_drain(mesh, call, request_id: str) -> None:
    """Cancel a streaming Generate through the conductor's Cancel: the stream must end with an
    error, and every node group must release the request."""
    await mesh.stub.Cancel(cpb.CancelRequest(request_id=request_id), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError):
        while await call.read() is not grpc.aio.EOF:
            pass
    await wait_released(mesh)


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
    """Signal a child (unless it already exited), wait for it, kill it if it will not go; its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


#: the launcher's ready line: model, REST url, gRPC address (``LauncherProcess.wait_lines``)
READY = re.compile(r"M\* ready: model '(\w+)' at (http://[\d.:]+) \(gRPC ([\d.:]+);")
#: the launcher's metrics line: JSON of each service's metrics url
METRICS = re.compile(r"M\* metrics: (\{.*\})")


class LauncherProcess:
    """``python -m mstar.cli ARGS`` as a user runs it. Its stdout is read line by line on a
    thread and its stderr (every service's too: they inherit it) goes to a temporary file, so a
    full pipe never blocks the mesh however long it runs and however much it logs."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self._err = tempfile.NamedTemporaryFile("w", prefix="mstar-launcher-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "mstar.cli", *args], stdout=subprocess.PIPE,
                                     stderr=self._err, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self._err.close()
        weakref.finalize(self, _remove, self._err.name)  # at collection or at exit, whichever comes first
        self.lines: queue.Queue[str | None] = queue.Queue()  # stdout; None once it closed
        self.stdout_lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def stdout(self) -> str:
        """Everything it printed on stdout (after it exited: the reader is given 10 s to finish)."""
        self._reader.join(10)
        return "".join(self.stdout_lines)

    def stderr(self, tail: int = 0) -> str:
        with open(self._err.name, errors="replace") as f:
            text = f.read()
        return text[-tail:] if tail else text

    def wait_lines(self, handle, timeout: float, what: str = "its ready lines"):
        """Feed stdout lines to ``handle`` until it returns something other than None (returned);
        AssertionError with the stderr tail if the launcher exits or ``timeout`` passes first
        (the launcher is then stopped)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"launcher exited {self.proc.wait(10)} before printing {what}: "
                                     f"{self.stderr(3000)}")
            if (out := handle(line)) is not None:
                return out
        code = self.stop()
        raise AssertionError(f"launcher did not print {what} within {timeout:g} s (stopped: exit {code}): "
                             f"{self.stderr(3000)}")

    def stop(self, timeout: float = 30) -> int:
        return stop_process(self.proc, timeout=timeout)


def forbid_video_decoding(monkeypatch) -> None:
    """From now on (until ``monkeypatch`` undoes it) ``av.open`` gives containers whose ``decode``
    fails the test: for size checks that must refuse a file from its header, before any frame."""
    import av

    real_open = av.open

    class Undecoded:
        def __init__(self, container):
            self.container, self.streams = container, container.streams

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.container.close()

        def decode(self, *a, **k):
            pytest.fail("a frame was decoded before its size was checked")

    monkeypatch.setattr(av, "open", lambda *a, **k: Undecoded(real_open(*a, **k)))


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def run_ranks(target, args: tuple, timeout_s: float, size: int = 2) -> None:
    """``target(rank, *args)`` in ``size`` spawned processes (tensor-parallel ranks); every one must
    exit 0 within ``timeout_s`` (stragglers are killed first)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"tensor-parallel ranks still running after {timeout_s} s"
    assert [p.exitcode for p in procs] == [0] * size


class Fn(NodeSubmodule):
    """A node that runs ``fn(call) -> outputs`` per call; ``stop(call, outputs)`` ends its loop."""

    def __init__(self, fn, stop=None):
        self.fn, self.stop = fn, stop

    def forward(self, calls):
        return [self.fn(c) for c in calls]

    def check_stop(self, call, outputs):
        return self.stop(call, outputs) if self.stop else False


class TensorModel(Model):
    """What test models share: any model_kwargs, the prompt as the request state, every emit
    a LATENT client output named like its edge."""

    def validate_kwargs(self, kwargs):
        return kwargs

    def process_prompt(self, prompt):
        return RequestState(prompt)

    def postprocess(self, state, emit):
        return [Output(emit.name, Modality.LATENT, tensor=emit.tensor)]
