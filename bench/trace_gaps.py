"""Where a served request's time goes on a GPU: reads a node group's torch.profiler trace
(``mstar serve --torch-profile DIR``: DIR/<group>-<pid>.trace.json.gz) and prints

- the GPU's busy and idle time over the window (kernels and copies merged into busy intervals);
- each labelled span (the NVTX spans: ``<walk>/<node> xN`` forwards and whole loops, ``<node> engine
  step``, frame batches sent and received) with its count and mean host time, and the kernel time
  that ran inside its window;
- the GPU's idle time by what the host was doing meanwhile: the outermost labelled span open on
  any thread at each idle stretch (or "no span": the event loop, gRPC, the conductor's turn), and
  the longest idle stretches with the CPU ops open then.

    python bench/trace_gaps.py DIR/<group>-<pid>.trace.json.gz [--since-ms 0] [--top 15] [--json OUT]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: idle stretches shorter than this (us) are counted together, not attributed to a span
SHORT_GAP_US = 20.0


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in data.get("traceEvents", data) if e.get("ph") == "X" and "dur" in e]


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def span_key(name: str) -> str:
    """A span's name without its batch size and frame counts (``decode/llm x3`` -> ``decode/llm``)."""
    return re.sub(r" x\d+$", "", re.sub(r"receive \d+ frames", "receive frames", name))


def summarize(events: list[dict], since_ms: float = 0.0, top: int = 15) -> dict:
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        raise SystemExit("no GPU events in this trace (a CPU-only node group, or the window held no work)")
    t0 = min(a for a, _ in gpu) + since_ms * 1e3
    gpu = [(a, b) for a, b in gpu if a >= t0]
    busy = merge(gpu)
    start, end = busy[0][0], busy[-1][1]
    idle = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1) if busy[i + 1][0] > busy[i][1]]
    spans = [e for e in events if e.get("cat") == "user_annotation" and e["ts"] >= t0]
    ops = [e for e in events if e.get("cat") == "cpu_op" and e["ts"] >= t0]

    starts = [a for a, _ in busy]
    prefix = [0.0]
    for a, b in busy:
        prefix.append(prefix[-1] + b - a)

    def busy_in(a: float, b: float) -> float:
        """GPU busy time inside [a, b]."""
        i, j = bisect.bisect_right(starts, a) - 1, bisect.bisect_left(starts, b)
        total = prefix[j] - prefix[max(i, 0)]
        if i >= 0 and busy[i][0] < a:
            total -= min(busy[i][1], a) - busy[i][0]
        if j - 1 >= 0 and busy[j - 1][1] > b:
            total -= busy[j - 1][1] - max(b, busy[j - 1][0])
        return max(total, 0.0)

    by_span: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for e in spans:
        s = by_span[span_key(e["name"])]
        s[0] += 1
        s[1] += e["dur"]
        s[2] += busy_in(e["ts"], e["ts"] + e["dur"])

    def open_at(items: list[dict], t: float) -> list[dict]:
        return [e for e in items if e["ts"] <= t <= e["ts"] + e["dur"]]

    idle_by: dict[str, float] = defaultdict(float)
    longest = sorted(idle, key=lambda g: g[0] - g[1])[:top]
    for a, b in idle:
        if b - a < SHORT_GAP_US:  # between the kernels of one graph replay or one op sequence
            idle_by[f"gaps under {SHORT_GAP_US:g} us"] += b - a
            continue
        here = open_at(spans, (a + b) / 2)
        outer = min(here, key=lambda e: e["ts"])["name"] if here else "no span"
        idle_by[span_key(outer)] += b - a
    window = end - start
    return {
        "window_ms": window / 1e3,
        "gpu_busy_ms": sum(b - a for a, b in busy) / 1e3,
        "gpu_idle_ms": sum(b - a for a, b in idle) / 1e3,
        "spans": {k: {"count": int(c), "mean_host_ms": d / c / 1e3, "mean_gpu_busy_ms": g / c / 1e3}
                  for k, (c, d, g) in sorted(by_span.items(), key=lambda kv: -kv[1][1])},
        "idle_by_span_ms": dict(sorted(((k, v / 1e3) for k, v in idle_by.items()), key=lambda kv: -kv[1])),
        "longest_idle": [{"at_ms": (a - start) / 1e3, "ms": (b - a) / 1e3,
                          "spans": sorted({e["name"] for e in open_at(spans, (a + b) / 2)}),
                          "cpu_ops": sorted({e["name"] for e in open_at(ops, (a + b) / 2)})[:8]}
                         for a, b in longest],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--since-ms", type=float, default=0.0, help="skip this much of the window's start")
    ap.add_argument("--top", type=int, default=15, help="how many of the longest idle stretches to list")
    ap.add_argument("--json", help="also write the summary as JSON here")
    args = ap.parse_args()
    out = summarize(load(args.trace), args.since_ms, args.top)
    print(f"window {out['window_ms']:.1f} ms: GPU busy {out['gpu_busy_ms']:.1f} ms, idle {out['gpu_idle_ms']:.1f} ms")
    print("\nspans: count, mean host ms, mean GPU-busy ms inside")
    for k, s in out["spans"].items():
        print(f"  {k:60s} {s['count']:6d} {s['mean_host_ms']:9.3f} {s['mean_gpu_busy_ms']:9.3f}")
    print("\nGPU idle by the outermost span open on the host then (ms)")
    for k, v in out["idle_by_span_ms"].items():
        print(f"  {k:60s} {v:9.1f}")
    print("\nlongest idle stretches")
    for g in out["longest_idle"]:
        print(f"  +{g['at_ms']:9.1f} ms  {g['ms']:7.3f} ms  spans={g['spans']}  ops={g['cpu_ops']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
