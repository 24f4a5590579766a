"""Where a served Orpheus step's time goes on the GPU: N streams through the real mesh, a
kernel trace of every process for a short window mid-run (gpu_trace/sitecustomize.py),
then one table: per process its kernel-busy share of the window, the LLM's steps (a step =
one fused-sampler launch), its kernel time per step, its idle gaps and how much of them the
codec process's kernels fill.

    PYTHONPATH=bench/orpheus/gpu_trace:$PYTHONPATH python bench/orpheus/trace_served.py \
        --root /tmp/orpheus-ckpt --out $OUT/trace16.json --streams 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_orpheus import PLACEMENTS, mstar_level, start_mesh, write_checkpoints  # noqa: I001  (same folder)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
from gpu_timing import intervals, overlap, time_by_name, union  # noqa: E402  (bench/engines)


def analyze(folder: Path, step_marker: str) -> dict:
    procs = {}
    for t in folder.glob("trace-*.json.gz"):
        pid = t.name.split("-")[1].split(".")[0]
        argv = (folder / f"argv-{pid}.txt").read_text()
        iv = intervals(t)
        if not iv:
            continue
        is_engine = any(step_marker in n for _, _, n in iv)
        name = "llm_engine" if is_engine else ("codec" if "codec" in argv else f"pid{pid}")
        procs[name] = iv
    res: dict = {}
    t0 = max(iv[0][0] for iv in procs.values())
    t1 = min(iv[-1][1] for iv in procs.values())
    res["window_ms"] = (t1 - t0) / 1e3
    clip = {k: [(max(a, t0), min(b, t1), n) for a, b, n in iv if b > t0 and a < t1] for k, iv in procs.items()}
    unions = {k: union(v) for k, v in clip.items()}
    for k, u in unions.items():
        res[f"{k}_busy_fraction"] = sum(b - a for a, b in u) / (t1 - t0)
        res[f"{k}_kernels"] = len(clip[k])
    if "llm_engine" in clip:
        iv = clip["llm_engine"]
        marks = [a for a, _, n in iv if step_marker in n]
        periods = [(b - a) / 1e3 for a, b in zip(marks, marks[1:], strict=False)]
        res["llm_steps"] = len(periods)
        res["llm_step_period_ms_mean"] = statistics.mean(periods)
        res["llm_step_period_ms_p50"] = statistics.median(periods)
        res["llm_step_period_ms_max"] = max(periods)
        u = unions["llm_engine"]
        busy = [sum(max(0.0, min(b, m2) - max(a, m1)) for a, b in u) / 1e3 for m1, m2 in zip(marks, marks[1:], strict=False)]
        res["llm_busy_ms_per_step_mean"] = statistics.mean(busy)
        gaps = [(b1, a2) for (_, b1), (a2, _) in zip(u, u[1:], strict=False)]
        big = [(a, b) for a, b in gaps if b - a > 5]
        res["llm_gap_ms_per_step"] = sum(b - a for a, b in gaps) / 1e3 / max(1, len(periods))
        res["llm_gaps_over_5us"] = len(big)
        res["llm_gaps_over_5us_ms_total"] = sum(b - a for a, b in big) / 1e3
        if "codec" in unions:
            res["codec_in_llm_gaps_ms"] = overlap(gaps, unions["codec"]) / 1e3
            res["codec_overlapping_llm_kernels_ms"] = overlap(u, unions["codec"]) / 1e3
        res["llm_top_kernels_ms"] = {n: t / 1e3 for n, t, _ in time_by_name(iv, 60, 15)}
        res["largest_gaps_us"] = sorted((round(b - a, 1) for a, b in gaps), reverse=True)[:20]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", help="checkpoint folder to reuse (written there if missing)")
    ap.add_argument("--streams", default="16", help="levels, each traced once")
    ap.add_argument("--max-tokens", type=int, default=434)
    ap.add_argument("--delay", type=float, default=0.5, help="seconds into the level before the trace starts")
    ap.add_argument("--placement", choices=PLACEMENTS, default="split")
    ap.add_argument("--model-kwargs", default='{"snac_dtype": "bfloat16", "snac_stride_frames": 2}')
    ap.add_argument("--marker", default="_sample", help="a kernel name part seen once per LLM step")
    args = ap.parse_args()
    spec = os.environ.get("MSTAR_GPU_TRACE", "")
    if spec.count(",") != 1:
        ap.error("set MSTAR_GPU_TRACE=DIR,SECONDS and put bench/orpheus/gpu_trace first on PYTHONPATH")
    trace_dir, trace_s = spec.split(",")
    folder = Path(trace_dir)
    folder.mkdir(parents=True, exist_ok=True)
    root = Path(args.root or tempfile.mkdtemp(prefix="orpheus-trace-"))
    if not (root / "hubertsiuzdak").exists():
        write_checkpoints(root, tiny=False)
    mesh = start_mesh(root, args.placement, json.loads(args.model_kwargs))
    results = []
    try:
        for k, n in enumerate(int(x) for x in args.streams.split(",")):
            asyncio.run(mstar_level(mesh.conductor_address, n, 32))
            plain = asyncio.run(mstar_level(mesh.conductor_address, n, args.max_tokens))
            timer = threading.Timer(args.delay, lambda k=k: (folder / f"start-{k}").touch())
            timer.start()
            traced = asyncio.run(mstar_level(mesh.conductor_address, n, args.max_tokens))
            time.sleep(float(trace_s) + 3)  # the processes' traces are written
            res = {"streams": n, "untraced_level": plain, "traced_level": traced, **analyze(folder / str(k), args.marker)}
            print(json.dumps(res, indent=2), flush=True)
            results.append(res)
    finally:
        mesh.stop()
    Path(args.out).write_text(json.dumps({"placement": args.placement, "model_kwargs": json.loads(args.model_kwargs),
                                          "levels": results}, indent=2))


if __name__ == "__main__":
    main()
