"""Where a decode step's device time goes, end to end: the KV-cache engine on the
Llama-3.2-3B-shaped model of decode_bench.py, ``batch`` sequences decoding (temperature 1), a
torch.profiler kernel trace of ``--steps`` consecutive engine steps once the contexts reach
``--ctx`` tokens. Per batch: step period (one step = one launch of the ``--marker`` kernel),
device-busy time and idle gaps per step, kernel time per step by name. Plus the sampler
alone (torch path vs the fused kernels; device time by CUDA events and host time per call).

    python bench/engines/step_trace.py --out step_trace.json --batches 1,16,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from decode_bench import GIB, SHAPE, build_models  # noqa: I001  (same folder)
from gpu_timing import graph_replay_ms, intervals, time_by_name, union

from mstar.services.engines import EngineConfig, KVCacheEngine, SamplingParams
from mstar.services.engines.sampling import Sampler


def trace_steps(eng: KVCacheEngine, batch: int, prompt: int, ctx: int, steps: int, marker: str,
                gen: torch.Generator) -> dict:
    vocab = eng.model.config.vocab_size
    params = SamplingParams(temperature=1.0, max_tokens=ctx - prompt + steps + 8)
    for i in range(batch):
        eng.add_request(f"t{i}", torch.randint(0, vocab, (prompt,), generator=gen).tolist(), params)
    for _ in range(ctx - prompt):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json.gz"
        prof.export_chrome_trace(str(path))
        iv = intervals(path)
    while eng.has_work:  # finish and release
        for e in eng.step():
            if e.status.finished:
                eng.release(e.request_id)
    for i in range(batch):
        eng.release(f"t{i}")
    marks = [a for a, _, n in iv if marker in n]
    if len(marks) < 3:
        return {"batch": batch, "error": f"{len(marks)} launches of a kernel named like {marker!r}",
                "kernels": sorted({n[:80] for *_, n in iv})[:40]}
    m0, m1 = marks[0], marks[-1]
    n_steps = len(marks) - 1
    inside = [(max(a, m0), min(b, m1), n) for a, b, n in iv if b > m0 and a < m1]
    busy = union(inside)
    top = time_by_name(inside, 90, 25)
    gaps = sorted((a2 - b1 for (_, b1), (a2, _) in zip(busy, busy[1:], strict=False)), reverse=True)
    by_pair: dict[str, float] = {}  # idle time by (kernel before, kernel after)
    end, before = inside[0][1], inside[0][2]
    for a, b, n in inside[1:]:
        if a > end:
            key = f"{before[:45]} -> {n[:45]}"
            by_pair[key] = by_pair.get(key, 0.0) + (a - end)
        if b > end:
            end, before = b, n
    periods = [(b - a) / 1e3 for a, b in zip(marks, marks[1:], strict=False)]
    return {
        "batch": batch, "ctx": ctx, "steps": n_steps, "wall_ms_per_step": wall / steps * 1e3,
        "period_ms_median": statistics.median(periods), "period_ms_mean": statistics.mean(periods),
        "busy_us_per_step": sum(b - a for a, b in busy) / n_steps,
        "gap_us_per_step": sum(gaps) / n_steps, "largest_gaps_us": [round(g, 1) for g in gaps[:12]],
        "kernels_per_step": len(inside) / n_steps,
        "gap_us_per_step_by_pair": {k: round(v / n_steps, 1) for k, v in sorted(by_pair.items(), key=lambda x: -x[1])[:15]},
        "top_us_per_step": {n: round(t / n_steps, 1) for n, t, _ in top},
        "launches_per_step": {n: round(c / n_steps, 2) for n, _, c in top},
    }


def sampler_times(vocab: int, batches: list[int], reps: int = 50) -> list[dict]:
    """The sampler alone on bf16 logits, temperature 1: torch path vs fused kernels."""
    rows = []
    for b in batches:
        logits = torch.randn(b, vocab, device="cuda").to(torch.bfloat16) * 3
        params = [SamplingParams(temperature=1.0)] * b
        row: dict = {"batch": b}
        for name, fused in (("torch", False), ("fused", True)):
            s = Sampler(seed=0, fused=fused)
            for _ in range(5):
                s(logits, params)
            torch.cuda.synchronize()
            dev, host = [], []
            for _ in range(reps):
                a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                t0 = time.perf_counter()
                s(logits, params)
                host.append((time.perf_counter() - t0) * 1e6)
                e.record()
                e.synchronize()
                dev.append(a.elapsed_time(e) * 1e3)
            row[f"{name}_us"] = statistics.median(dev)
            row[f"{name}_host_us"] = statistics.median(host)
        rows.append(row)
    return rows


def embed_times(vocab: int, hidden: int, batches: list[int], copies: int = 20) -> list[dict]:
    """Embedding rows for a decode step, ``copies`` lookups in one CUDA graph, µs per lookup:
    nn.Embedding (index_select) vs advanced indexing (what LlamaForCausalLM.embed uses)."""
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    rows = []
    for b in batches:
        ids = torch.randint(0, vocab, (b,), device="cuda")
        assert torch.equal(torch.nn.functional.embedding(ids, w), w[ids])
        rows.append({"batch": b,
                     "index_select_us": graph_replay_ms(lambda: [torch.nn.functional.embedding(ids, w)  # noqa: B023
                                                                 for _ in range(copies)]) * 1e3 / copies,
                     "indexing_us": graph_replay_ms(lambda: [w[ids] for _ in range(copies)]) * 1e3 / copies})  # noqa: B023
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=192, help="cached tokens when the trace starts")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--marker", default="_full_pick", help="a kernel name part launched once per step")
    ap.add_argument("--config", default="{}", help="EngineConfig fields to change, as JSON")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    r: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    batches = [int(x) for x in args.batches.split(",")]
    r["sampler"] = sampler_times(SHAPE["vocab_size"], batches)
    print("sampler", json.dumps(r["sampler"]), flush=True)
    r["embed"] = embed_times(SHAPE["vocab_size"], SHAPE["hidden_size"], sorted({1, 8, 16, 17, 32, 64} | set(batches)))
    print("embed", json.dumps(r["embed"]), flush=True)
    hf, ours = build_models(SHAPE, "cuda")
    del hf
    torch.cuda.empty_cache()
    cfg = EngineConfig(page_size=16, kv_cache_bytes=12 * GIB, max_num_seqs=64, max_num_batched_tokens=8192,
                       attention="flashinfer", **json.loads(args.config))
    eng = KVCacheEngine(ours, cfg)
    r["steps"] = []
    for b in batches:
        r["steps"].append(trace_steps(eng, b, args.prompt, args.ctx, args.steps, args.marker, gen))
        print("steps", json.dumps(r["steps"][-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
