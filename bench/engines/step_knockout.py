"""What one kind of kernel costs a decode step on its critical path: the Llama-3.2-3B-shaped model of
decode_bench.py in the engine's batch-16 decode graph, replayed with one kernel kind removed.

A kernel's own duration in a trace overstates what it costs where kernels overlap (programmatic
dependent launches let the next one start during its tail). Here each variant captures the graph
without that kernel and times the replay (CUDA events, median of ``--reps``), so the difference
to the full graph is what the step would gain if the kernel took no time at all: an upper bound
on what optimising it can win. A knocked-out graph's outputs are garbage (timing only; the replays
read no value that steers control flow); the others' are summed, to show variants that change no
arithmetic give the same outputs.

Variants (``--variants``):
- ``full``: the engine's graph as it runs;
- ``no_attention``: the fused RoPE + K/V store + attention kernel replaced by nothing (o_proj reads
  q straight from the qkv output);
- ``no_silu``: the SiLU·mul + row-scale kernel replaced by nothing (down reads the gate half);
- ``ctx1``: the full graph with one cached token a sequence instead of ``--ctx`` (the attention's
  share that grows with the context);
- ``no_attention_rowscale``: the attention kernel without its row scale (it reads no residual row
  and computes no 1 / rms);
- ``one_split`` / ``one_split_ctx1``: the attention kernel launched with one KV split (half the
  programs at batch 16: a graph's split count is fixed at capture, and a step uses fewer only by
  leaving the rest idle).

    python bench/engines/step_knockout.py --out step_knockout.json --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from contextlib import contextmanager

import torch
from decode_bench import GIB, SHAPE, build_models  # noqa: I001  (same folder)

from mstar.services.engines import EngineConfig, KVCacheEngine
from mstar.services.engines.batch import SeqSlice
from mstar.services.engines.direct import ForwardItem

VARIANTS = ("full", "no_attention", "no_silu", "ctx1", "one_split", "one_split_ctx1", "no_attention_rowscale")


@contextmanager
def knocked_out(variant: str):
    """Patch the kernel of ``variant`` away while a graph is captured."""
    from mstar.services.engines import attn_triton, rowscale_triton

    saved = []
    if variant.startswith("one_split"):
        saved.append((attn_triton, "TARGET_PROGRAMS", attn_triton.TARGET_PROGRAMS))
        attn_triton.TARGET_PROGRAMS = 1
    if variant in ("no_attention", "no_attention_rowscale"):
        cls = attn_triton.TritonGraphDecode
        saved.append((cls, "run_rope_store", cls.run_rope_store))
        original = cls.run_rope_store
        if variant == "no_attention":
            cls.run_rope_store = lambda self, q, *a, **k: q
        else:
            cls.run_rope_store = lambda self, *a, row_rms=None: original(self, *a, row_rms=None)
    elif variant == "no_silu":
        saved.append((rowscale_triton, "silu_mul_rowscale", rowscale_triton.silu_mul_rowscale))
        rowscale_triton.silu_mul_rowscale = lambda x, src, eps, pdl=False: x[:, : x.shape[1] // 2]
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def forward_ms(model, variant: str, batch: int, ctx: int, reps: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)  # the same contexts in every variant: outputs comparable
    cfg = EngineConfig(page_size=16, kv_cache_bytes=4 * GIB, max_num_seqs=batch, max_num_batched_tokens=8192,
                       attention="flashinfer", graph_batch_sizes=(batch,))
    with knocked_out(variant):
        eng = KVCacheEngine(model, cfg)
    try:
        vocab = model.config.vocab_size
        n_ctx = 1 if variant.endswith("ctx1") else ctx
        rids = [f"k{i}" for i in range(batch)]
        eng.forward([ForwardItem(r, token_ids=torch.randint(0, vocab, (n_ctx,), generator=gen)) for r in rids])
        for r in rids:
            eng.cache.reserve(r, "main", n_ctx + 1)
        graphs = eng.runner.graphs
        inputs = graphs.prepare([SeqSlice(r, "main", n_ctx, 1) for r in rids])
        out = eng.runner.run(inputs, token_ids=torch.zeros(batch, dtype=torch.long, device=eng.device))
        digest = out.float().sum().item()
        times = []
        for i in range(reps + 5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs.replay_last()
            b.record()
            b.synchronize()
            if i >= 5:
                times.append(a.elapsed_time(b))
        return statistics.median(times), digest
    finally:
        del eng
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2, help="each variant this many times, rounds interleaved")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    _, model = build_models(SHAPE, "cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "ms": {}}
    for r in range(args.rounds):
        for v in variants:
            ms, digest = forward_ms(model, v, args.batch, args.ctx, args.reps)
            res["ms"].setdefault(v, []).append(ms)
            res.setdefault("output_sum", {}).setdefault(v, []).append(digest)
            print(f"round {r + 1} {v}: {ms:.4f} ms (output sum {digest!r})", flush=True)
    full = statistics.mean(res["ms"]["full"]) if "full" in res["ms"] else None
    res["mean_ms"] = {v: statistics.mean(x) for v, x in res["ms"].items()}
    if full:
        res["saved_us_per_layer"] = {v: (full - m) * 1e3 / SHAPE["num_hidden_layers"] for v, m in res["mean_ms"].items()}
    print(json.dumps({k: res[k] for k in ("mean_ms", "saved_us_per_layer") if k in res}), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
