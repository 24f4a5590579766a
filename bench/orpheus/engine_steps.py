"""The Orpheus LLM engine alone (no mesh): decode step time with Orpheus' sampling knobs vs
plain sampling, and how busy the GPU is during steps. Tells served overhead from engine cost.

    python engine_steps.py --root /tmp/orpheus-ckpt --out engine_steps.json [--batches 16,128]

The checkpoint is the random full-size one bench_orpheus.py writes (written if missing).
``first_window_ms_p50``: from adding the B prompts at once to a request's 28th token (the first
SNAC window), the engine's part of the time to first audio. Each variant: B requests of a 64-token prompt decode 256 tokens (min_tokens-free: stop ids
are left out so every row runs the full length); median step over steps where all B decode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from bench_orpheus import KNOBS, write_checkpoints

from mstar.models.base import NodeContext
from mstar.models.orpheus.llm_node import CODE_CYCLE, build_engine, engine_config
from mstar.services.engines.sampling import SamplingParams

PROMPT, NEW = 64, 256
WINDOW = 28  # tokens in the first SNAC window: the engine's share of the time to first audio
ORPHEUS = SamplingParams(temperature=KNOBS["temperature"], top_p=KNOBS["top_p"], repetition_penalty=KNOBS["repetition_penalty"],
                         max_tokens=NEW, allowed_token_cycle=CODE_CYCLE, seed=1)
VARIANTS = {
    "orpheus": ORPHEUS,
    "orpheus_full_head": ORPHEUS,  # logits over the whole vocabulary (no EngineConfig.head_ranges)
    "orpheus_torch_sampler": ORPHEUS,  # the torch sampler's ops instead of the fused Triton kernel
    "orpheus_no_rep_penalty": replace(ORPHEUS, repetition_penalty=1.0),
    "orpheus_no_top_p": replace(ORPHEUS, top_p=1.0),
    "orpheus_greedy": replace(ORPHEUS, temperature=0.0),
    "plain_t1": SamplingParams(temperature=1.0, max_tokens=NEW, seed=1),
}


@torch.inference_mode()
def run(engine, batch: int, params: SamplingParams, profile: bool) -> dict:
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(1000, 100000, (batch, PROMPT), generator=gen).tolist()
    t_start = time.perf_counter()
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", ids[i], replace(params, seed=i if params.seed is not None else None))
    times, pipelined0 = [], engine.stats.pipelined_steps
    counts: dict[str, int] = {}
    window_at: list[float] = []  # per request: when its first SNAC window (28 tokens) was complete
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof = None
    k = 0
    while engine.has_work:
        if profile and k == 100:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            t_prof = time.perf_counter()
        t0 = time.perf_counter()
        events = engine.step()
        times.append((time.perf_counter() - t0, len(events)))
        if prof is not None and k == 120:
            torch.cuda.synchronize()
            wall = time.perf_counter() - t_prof
            prof.__exit__(None, None, None)
            kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
            prof = None
            busy = {"wall_ms_20_steps": 1e3 * wall, "kernel_ms_20_steps": kernel_us / 1e3}
        for ev in events:
            counts[ev.request_id] = counts.get(ev.request_id, 0) + 1
            if counts[ev.request_id] == WINDOW:
                window_at.append(time.perf_counter() - t_start)
            if ev.status.finished:
                engine.release(ev.request_id)
        k += 1
    full = [t for t, n in times if n == batch]
    out = {"batch": batch, "steps": len(times), "full_steps": len(full), "step_ms_p50": 1e3 * statistics.median(full),
           "step_ms_mean": 1e3 * statistics.mean(full),
           "tokens_per_s": batch / statistics.median(full), "pipelined_steps": engine.stats.pipelined_steps - pipelined0,
           "first_window_ms_p50": 1e3 * statistics.median(window_at)}
    if profile:
        out.update(busy)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="16,128")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks this script, measures nothing")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="of " + ", ".join(VARIANTS))
    ap.add_argument("--no-warm-sampler", action="store_true",
                    help="build the engine without its start-up sampler warm-up (KVCacheEngine.warm_sampler): "
                    "with a fresh TRITON_CACHE_DIR, warmup_b8.first_window_ms_p50 then shows the first-use compile")
    ap.add_argument("--model-kwargs", default="{}", help="JSON merged into the node's model_kwargs (e.g. fused_norms)")
    args = ap.parse_args()
    root = Path(args.root)
    if not (root / "hubertsiuzdak").exists():
        write_checkpoints(root, tiny=args.tiny)
    ckpt = root / "canopylabs" / "orpheus-3b-0.1-ft"
    dev = "cpu" if args.tiny else "cuda:0"
    kw = {"gpu_memory_fraction": 0.8, "max_num_seqs": 256, **({"kv_cache_bytes": 64 << 20} if args.tiny else {}),
          **json.loads(args.model_kwargs)}
    if args.no_warm_sampler:
        from mstar.services.engines.kv_engine import KVCacheEngine

        KVCacheEngine.warm_sampler = lambda self, params: None
    t0 = time.perf_counter()
    engine = build_engine(ckpt, dev, engine_config(NodeContext("llm", dev, None, kw)))
    res = {"device": torch.cuda.get_device_name() if not args.tiny else "cpu", "torch": torch.__version__,
           "prompt": PROMPT, "new_tokens": NEW, "engine_build_s": time.perf_counter() - t0,
           "warm_sampler": not args.no_warm_sampler, "model_kwargs": kw, "runs": []}
    res["warmup_b8"] = run(engine, 8, ORPHEUS, False)  # the warm-up: the first requests of a fresh engine
    print("warmup_b8", json.dumps(res["warmup_b8"]), flush=True)
    variants = {k: VARIANTS[k] for k in args.variants.split(",")}
    for b in [1] + [int(x) for x in args.batches.split(",")]:
        for name, params in variants.items():
            head, fused = engine._head_cols, engine.sampler._fused
            if name == "orpheus_full_head":
                engine._head_cols = None
            if name == "orpheus_torch_sampler":
                engine.sampler._fused = False
            try:
                r = {"variant": name, **run(engine, b, params, profile=not args.tiny and name in
                                            ("orpheus", "orpheus_torch_sampler", "plain_t1"))}
            finally:
                engine._head_cols, engine.sampler._fused = head, fused
            print(json.dumps(r), flush=True)
            res["runs"].append(r)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
