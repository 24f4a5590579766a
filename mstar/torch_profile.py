"""A torch.profiler trace of a node group (or the conductor) while it serves (``mstar serve
--torch-profile DIR``, or MSTAR_TORCH_PROFILE=DIR): its CPU ops on every thread, its CUDA kernels
(those of CUDA-graph replays included), the host's CUDA syncs, and the NVTX spans (each node's
forward or whole loop, each engine step, each frame batch sent or received; the conductor's reading
of a request, its first walk, each frame batch in) as labelled ranges, so the gaps between a
request's GPU work show with what the host was doing then. No Nsight needed.

Armed, a service records nothing until told: SIGUSR1 (``kill -USR1 <pid>``) starts a recording,
the next SIGUSR1 ends it, and so does MSTAR_TORCH_PROFILE_S seconds (default 10) after its start:
the profiler holds every event in memory, so a window bounds it. Each recording k is written, on a
thread, into DIR:

- ``<group>-<pid>-<k>.trace.json.gz``: the timeline (Perfetto or chrome://tracing open it);
- ``<group>-<pid>-<k>.ops.txt``: the ops and kernels by total CUDA time, then by CPU time.

Recording slows the host side (every op is timed): time requests without it. Off (the default)
nothing is imported and nothing is recorded.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

_local = threading.local()
T = TypeVar("T")


def _push(name: str) -> None:
    import torch

    rf = torch.autograd.profiler.record_function(name)
    rf.__enter__()
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(rf)


def _pop() -> None:
    _local.stack.pop().__exit__(None, None, None)


@dataclass
class Recording:
    prof: Any  # the stopped torch.profiler.profile (torch is imported when recording starts)
    stem: Path  # its files' path without their suffixes


class TorchProfile:
    """``start()`` / ``stop()`` on the service's event-loop thread (the thread that started the
    profiler stops it), then ``write(recording)`` on any thread."""

    def __init__(self, folder: str, name: str, window_s: float):
        self.folder, self.name, self.window_s = Path(folder), f"{name}-{os.getpid()}", window_s
        self.folder.mkdir(parents=True, exist_ok=True)
        self._prof: Any = None  # the torch.profiler.profile recording, if one is
        self.recordings = 0  # started so far

    @property
    def recording(self) -> bool:
        return self._prof is not None

    def start(self) -> int:
        """Start recording; its number k (the files' suffix)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        from mstar import nvtx

        assert self._prof is None, "already recording"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        # every thread's ops (the forward and engine threads predate the profiler: by default only
        # the starting thread's are recorded), and the host's CUDA syncs as events
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
        self._prof = profile(activities=activities, experimental_config=config)
        self._prof.start()
        if nvtx.ACTIVE:  # both: each span is an NVTX range and a profiler range
            push, pop = nvtx.stacked(_push, _pop)
        else:
            push, pop = _push, _pop
        nvtx.configure(True, push, pop)
        self.recordings += 1
        log.info("torch profiler recording %d for at most %.0f s, into %s", self.recordings, self.window_s, self.folder)
        return self.recordings

    def stop(self) -> Recording | None:
        """End the recording (None: none was on); ``write`` it next."""
        prof, self._prof = self._prof, None
        if prof is None:
            return None
        from mstar import nvtx

        nvtx.from_settings()  # spans back to what MSTAR_NVTX says
        prof.stop()
        return Recording(prof, self.folder / f"{self.name}-{self.recordings}")

    @staticmethod
    def write(rec: Recording) -> list[Path]:
        """The recording's files (their paths). Slow for a long window: a thread's work."""
        trace, table = (rec.stem.with_name(rec.stem.name + ext) for ext in (".trace.json.gz", ".ops.txt"))
        rec.prof.export_chrome_trace(str(trace))  # gzipped by torch for a .gz path
        averages = rec.prof.key_averages()
        cuda = any(getattr(e, "device_time_total", 0) for e in averages)
        with open(table, "w") as f:
            if cuda:
                f.write(averages.table(sort_by="device_time_total", row_limit=60, max_name_column_width=90) + "\n\n")
            f.write(averages.table(sort_by="cpu_time_total", row_limit=60, max_name_column_width=90) + "\n")
        log.info("torch profile written: %s, %s", trace, table)
        return [trace, table]


def arm(name: str, loop) -> TorchProfile | None:
    """MSTAR_TORCH_PROFILE (a node group's, the conductor's): SIGUSR1 starts a torch.profiler
    recording on ``loop``, the next one (or its window's end) stops it and writes it on a thread.
    The TorchProfile, or None (off). Recordings are named after ``name``; ``write_pending`` at the
    service's stop."""
    from mstar import env

    folder = env.settings().torch_profile
    if not folder:
        return None
    profile = TorchProfile(folder, name, env.settings().torch_profile_s)

    def finish(k: int | None = None) -> None:
        if k is not None and k != profile.recordings:  # the window of a recording already ended
            return
        rec = profile.stop()
        if rec is not None:
            loop.run_in_executor(None, profile.write, rec)

    def toggle() -> None:
        if profile.recording:
            finish()
        else:
            loop.call_later(profile.window_s, finish, profile.start())
    loop.add_signal_handler(signal.SIGUSR1, toggle)
    log.info("%s: torch profiler armed (kill -USR1 %d starts and stops a recording, into %s)", name, os.getpid(), folder)
    return profile


async def write_pending(profile: TorchProfile | None, loop) -> None:
    """At a service's stop: a recording still on is stopped and written before the service drains."""
    recording = profile.stop() if profile is not None else None
    if recording is not None:
        await loop.run_in_executor(None, TorchProfile.write, recording)


def record_around(pids: list[int], folder: Path, run: Callable[[], T], timeout_s: float = 300.0) -> tuple[T, list[str]]:
    """Benchmarks: start a recording in each of ``pids`` (node groups or the conductor, serving with
    ``--torch-profile folder``), ``run()``, stop them, and wait until each has written its trace.
    Returns run's result and the folder's file names. Each SIGUSR1 is handled on its service's
    event loop, so the recordings start within a moment of the signal; arm the services with a
    window (MSTAR_TORCH_PROFILE_S) longer than ``run`` takes."""
    before = len(list(folder.glob("*.ops.txt")))
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.5)
    try:
        result = run()
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while len(list(folder.glob("*.ops.txt"))) < before + len(pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the services' torch profiles did not appear in {folder} within {timeout_s:.0f} s")
        time.sleep(0.5)
    return result, sorted(p.name for p in folder.iterdir())
