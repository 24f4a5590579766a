"""Timing shared by the benchmarks: device time of a CUDA graph of a function, wall time of calls
with the device waited for, rows recorded as they finish, kernel tables of a run's parts."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch


def graph_replay_ms(fn: Callable[[], object], reps: int = 20, warm: int = 3) -> float:
    """Median device time (ms, CUDA events) of one replay of a graph captured from ``fn``: ``fn``
    runs twice on a side stream first (lazy init, autotuning), then ``warm`` untimed replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warm):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def wall_s(fn: Callable[[], object], device: str, reps: int, warmup: int = 1) -> list[float]:
    """Wall seconds of ``reps`` calls of ``fn`` after ``warmup`` untimed ones; on CUDA the device is
    idle before each timed call and waited for after it."""
    cuda = device.startswith("cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def record_row(result: dict, row: dict, out: str, t0: float, show: Callable[[str], bool] = lambda key: True) -> None:
    """Print ``row`` (floats rounded, only the keys ``show`` accepts), append it to
    ``result["rows"]`` and rewrite ``out``, so a cut-off run keeps every finished row."""
    print(json.dumps({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items() if show(a)}), flush=True)
    result["rows"].append(row)
    result["elapsed_s"] = time.time() - t0
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def profile_parts(folder: str, parts: dict[str, Callable[[], object]], device: str, reps: int = 3) -> None:
    """Each part's kernels over ``reps`` runs (after one unprofiled run): a table by CUDA time, and
    the kernel count per run, to ``folder/<part>.txt``."""
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    cuda = device.startswith("cuda")
    for name, fn in parts.items():
        fn()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(reps):
                fn()
            if cuda:
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                          row_limit=40, max_name_column_width=90)
        gpu_us = sum(e.device_time for e in kernels) / reps
        with open(os.path.join(folder, f"{name}.txt"), "w") as f:
            f.write(f"{name}: {len(kernels) / reps:.0f} kernels and {gpu_us:.0f} us of kernel time a run ({reps} runs)\n\n{table}\n")
