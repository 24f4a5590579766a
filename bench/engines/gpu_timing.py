"""Device time of a CUDA graph of a function, shared by the engine micro-benchmarks."""

from __future__ import annotations

import statistics
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
