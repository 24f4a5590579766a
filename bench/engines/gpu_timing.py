"""Device time of a CUDA graph of a function, launch-configuration sweeps, and kernel intervals
from torch.profiler traces: shared by the engine micro-benchmarks and the trace scripts."""

from __future__ import annotations

import gzip
import itertools
import json
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

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


def record_row(result: dict, row: dict, out: str, t0: float, show: Callable[[str], bool] = lambda key: True) -> None:
    """Print ``row`` (floats rounded, only the keys ``show`` accepts), append it to
    ``result["rows"]`` and rewrite ``out``, so a cut-off run keeps every finished row."""
    import time

    print(json.dumps({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items() if show(a)}), flush=True)
    result["rows"].append(row)
    result["elapsed_s"] = time.time() - t0
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def add_grid_args(ap, **defaults: str) -> None:
    """Launch-configuration sweep options (``--block-n 16,32`` ...), one per keyword, in order."""
    for name, default in defaults.items():
        ap.add_argument("--" + name.replace("_", "-"), default=default)


def config_grid(args, names: Iterable[str]) -> list[tuple[int, ...]]:
    """Every combination of the comma-separated integer options ``names`` of ``args``, in order."""
    return list(itertools.product(*(map(int, getattr(args, a).split(",")) for a in names)))


def sweep(row: dict, prefix: str, configs: Iterable[tuple[int, ...]],
          run: Callable[[tuple[int, ...]], tuple[torch.Tensor, float]], want: torch.Tensor) -> tuple[float, str] | None:
    """Time launch configurations: ``run(cfg)`` returns (output, µs). Records ``{prefix}{key}_us``
    per configuration in ``row`` (``_rel_err`` when the output is off by more than 1e-2 relative,
    ``_error`` when it does not compile or fit); returns the fastest accurate (µs, key)."""
    best = None
    for cfg in configs:
        key = "x".join(map(str, cfg))
        try:
            out, us = run(cfg)
            err = ((out.float() - want).norm() / want.norm()).item()
        except Exception as e:  # a configuration that does not compile or fit
            row[f"{prefix}{key}_error"] = repr(e)[:200]
            continue
        row[f"{prefix}{key}_us"] = us
        if err > 1e-2:
            row[f"{prefix}{key}_rel_err"] = err
        elif best is None or us < best[0]:
            best = (us, key)
    return best


def intervals(trace: Path) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel, copy and memset in a gzipped chrome trace."""
    ev = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


def time_by_name(iv: list[tuple[float, float, str]], chars: int, top: int) -> list[tuple[str, float, int]]:
    """(name cut to ``chars``, total µs, launches) of the ``top`` kernels by total time."""
    acc: dict[str, list] = {}
    for a, b, n in iv:
        t = acc.setdefault(n[:chars], [0.0, 0])
        t[0] += b - a
        t[1] += 1
    return sorted(((n, t, c) for n, (t, c) in acc.items()), key=lambda x: -x[1])[:top]


def union(iv: list[tuple[float, float, str]]) -> list[tuple[float, float]]:
    """Sorted intervals merged where they touch or overlap: the spans the device was busy."""
    out: list[list[float]] = []
    for a, b, _ in iv:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(spans: list[tuple[float, float]], other: list[tuple[float, float]]) -> float:
    """Total length of ``spans`` covered by ``other`` (both sorted and disjoint)."""
    tot, j = 0.0, 0
    for a, b in spans:
        while j < len(other) and other[j][1] <= a:
            j += 1
        k = j
        while k < len(other) and other[k][0] < b:
            tot += max(0.0, min(b, other[k][1]) - max(a, other[k][0]))
            k += 1
    return tot


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
