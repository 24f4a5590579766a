"""Where a decode step's device time goes, on the Llama-3.2-3B shape (GPU, random bf16 weights).

1. GEMM efficiency: each projection of the model (fused qkv, o, fused gate_up, down, LM head)
   at batch 1-128, as ``F.linear`` (what the model runs) and as the swapped product
   ``w @ x.T``; weights rotated through enough copies to defeat the L2 cache; GB/s counts the
   bytes each GEMM must move once.
2. The captured decode forward (CUDA graph replay) and LM head + sampler at context 192 for
   each kernel set (``EngineConfig.kernels``: torch reference, FlashInfer) and
   decode-attention variant (split-KV at every batch size; FlashInfer's CUDA-core kernel).
3. Accuracy of each kernel set: logits of a prefill and a graph-replayed decode step vs the
   same weights in fp32 (torch kernels and attention), relative error and top-1 agreement.
4. A kernel table of one replayed step (torch.profiler), per kernel name: launches and µs.

    python bench/engines/step_profile.py --out step_profile.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from decode_bench import GIB, SHAPE, copy_bandwidth, device_breakdown
from gpu_timing import graph_replay_ms

from mstar.services.engines import (
    EngineConfig,
    ForwardItem,
    KVCacheEngine,
    LlamaConfig,
    LlamaForCausalLM,
    attn_flashinfer,
)
from mstar.services.engines.batch import SeqSlice
from mstar.services.engines.layers import set_weight_layout

DEFAULTS = (attn_flashinfer.GRAPH_DECODE_TENSOR_CORES, attn_flashinfer.GRAPH_DECODE_NO_SPLIT_FROM)
DEFAULT_NO_SPLIT_FROM = DEFAULTS[1]

MS = (1, 2, 4, 8, 16, 32, 64, 128, 2048)


def graph_time_ms(fn, reps: int = 20) -> float:
    """Median device time of one replay of a graph of ``fn``."""
    return graph_replay_ms(fn, reps)


@torch.inference_mode()
def gemm_sweep(dev: str, hidden: int, inter: int, q_size: int, kv_size: int, vocab: int) -> list[dict]:
    shapes = {"qkv": (q_size + 2 * kv_size, hidden), "o_proj": (hidden, q_size), "gate_up": (2 * inter, hidden),
              "down": (hidden, inter), "lm_head": (vocab, hidden)}
    rows = []
    for name, (n, k) in shapes.items():
        copies = max(2, math.ceil(400e6 / (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            nbytes = 2 * (n * k + m * k + m * n)
            row = {"gemm": name, "n": n, "k": k, "m": m}
            forms = [("linear", lambda x=x, ws=ws: [F.linear(x, w) for w in ws])]
            if m <= 128:
                forms.append(("swapped", lambda x=x, ws=ws: [w @ x.T for w in ws]))
            if m in (1, 16, 64, 2048):
                forms.append(("kn", lambda x=x, wts=wts: [x @ w for w in wts]))  # weights stored [K, N]
            if m in (1, 16, 64):
                forms.append(("lt", lambda x=x, ws=ws: [F.linear(x, w) for w in ws]))  # through cuBLASLt
            for form, fn in forms:
                lib = torch.backends.cuda.preferred_blas_library()
                if form == "lt":
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                try:
                    t = graph_time_ms(fn) / copies
                finally:
                    torch.backends.cuda.preferred_blas_library(lib)
                row[f"{form}_us"], row[f"{form}_GBps"] = t * 1e3, nbytes / (t * 1e-3) / 1e9
                row[f"{form}_TFLOPs"] = 2 * m * n * k / (t * 1e-3) / 1e12
            rows.append(row)
    return rows


@torch.inference_mode()
def store_sweep(dev: str, kv_heads: int = 8, head_dim: int = 128, layers: int = 28, pages: int = 4096) -> list[dict]:
    """K/V store of one step (all layers) as one index_put, one index_copy_, or two index_copy_."""
    kv = torch.randn(layers, 2, pages, 16, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    rows = []
    for m in (1, 16, 64):
        qkv = torch.randn(m, (3 * kv_heads + 2 * kv_heads) * head_dim, device=dev, dtype=torch.bfloat16)
        pair = qkv[:, 3 * kv_heads * head_dim :].view(m, 2, kv_heads, head_dim).transpose(0, 1)
        slots = torch.randperm(pages * 16, device=dev)[:m]

        def put(slots=slots, pair=pair):
            for layer in range(layers):
                kv[layer].view(2, -1, kv_heads, head_dim)[:, slots] = pair

        def copy1(slots=slots, pair=pair):
            for layer in range(layers):
                kv[layer].view(2, -1, kv_heads, head_dim).index_copy_(1, slots, pair)

        def copy2(slots=slots, pair=pair):
            for layer in range(layers):
                kv[layer, 0].view(-1, kv_heads, head_dim).index_copy_(0, slots, pair[0])
                kv[layer, 1].view(-1, kv_heads, head_dim).index_copy_(0, slots, pair[1])

        rows.append({"m": m, **{f"{name}_us_per_layer": graph_time_ms(fn) * 1e3 / layers
                                for name, fn in (("index_put", put), ("index_copy", copy1), ("two_index_copy", copy2))}})
    return rows


def read_bandwidth(dev: str, nbytes: int = 2 * GIB) -> float:
    """Bytes read per second by a reduction over a large tensor (the GEMV-like access)."""
    x = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
    t = graph_time_ms(lambda: x.sum(dtype=torch.float32), reps=10)
    return nbytes / (t * 1e-3)


def profile_replay(eng: KVCacheEngine, batch: int, ctx: int, gen: torch.Generator, steps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    vocab = eng.model.config.vocab_size
    rids = [f"pf{i}" for i in range(batch)]
    eng.forward([ForwardItem(r, token_ids=torch.randint(0, vocab, (ctx,), generator=gen)) for r in rids])
    for r in rids:
        eng.cache.reserve(r, "main", ctx + 1)
    inputs = eng.runner.graphs.prepare([SeqSlice(r, "main", ctx, 1) for r in rids])
    ids = torch.zeros(batch, dtype=torch.long, device=eng.device)
    graphs, table, mode = eng.runner.graphs, [], "graph replay"
    with torch.inference_mode():
        for mode in ("graph replay", "eager"):  # eager: same kernels, if the profiler misses graph nodes
            eng.runner.graphs = graphs if mode == "graph replay" else None
            eng.runner.run(inputs, token_ids=ids)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    eng.runner.run(inputs, token_ids=ids)
                torch.cuda.synchronize()
            for e in prof.key_averages():
                us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
                if us and e.count:
                    table.append({"kernel": e.key[:100], "launches_per_step": e.count / steps,
                                  "us_per_step": us / steps})
            if table:
                break
    eng.runner.graphs = graphs
    for r in rids:
        eng.release(r)
    table.sort(key=lambda r: -r["us_per_step"])
    return {"batch": batch, "ctx": ctx, "mode": mode, "kernel_us_per_step": sum(r["us_per_step"] for r in table),
            "launches_per_step": sum(r["launches_per_step"] for r in table), "top": table[:25]}


@torch.inference_mode()
def accuracy(model, ref_model, kinds: list[str], gen: torch.Generator, n_seqs: int = 4, prompt: int = 100) -> dict:
    """Prefill + one graph-replayed decode step per kernel set vs the fp32 model."""
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen) for _ in range(n_seqs)]
    nxt = torch.randint(0, vocab, (n_seqs,), generator=gen)

    def run(eng: KVCacheEngine, graphs: bool) -> torch.Tensor:
        hs = eng.forward([ForwardItem(f"a{i}", token_ids=p) for i, p in enumerate(prompts)])
        pre = torch.stack([h[-1] for h in hs])
        if graphs:
            slices = [SeqSlice(f"a{i}", "main", prompt, 1) for i in range(n_seqs)]
            for s in slices:
                eng.cache.reserve(s.request_id, "main", prompt + 1)
            dec = eng.runner.run(eng.runner.graphs.prepare(slices), token_ids=nxt.to(eng.device))
        else:
            dec = torch.cat(eng.forward([ForwardItem(f"a{i}", token_ids=nxt[i : i + 1]) for i in range(n_seqs)]))
        logits = eng.logits(torch.cat([pre, dec])).float()
        for i in range(n_seqs):
            eng.release(f"a{i}")
        return logits

    ref_eng = KVCacheEngine(ref_model, EngineConfig(page_size=16, kv_cache_bytes=GIB, attention="torch",
                                                    kernels="torch", cuda_graphs=False, overlap=False))
    want = run(ref_eng, graphs=False)
    del ref_eng
    out = {}
    for kind in kinds:
        eng = KVCacheEngine(model, EngineConfig(page_size=16, kv_cache_bytes=GIB, attention="flashinfer",
                                                kernels=kind, graph_batch_sizes=(n_seqs,)))
        got = run(eng, graphs=True)
        out[kind] = {"rel_err_vs_fp32": ((got - want).norm() / want.norm()).item(),
                     "top1_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
                     "rows": 2 * n_seqs}
        del eng
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", default="torch,flashinfer", help="kernel sets for the accuracy check")
    ap.add_argument("--variants",
                    default="torch,flashinfer,flashinfer/fi-graphs,flashinfer/triton,flashinfer/split,"
                            "flashinfer/cudacore,flashinfer/rowmajor",
                    help="kernel set[/option]: fi-graphs = FlashInfer decode attention in every graph, triton = "
                         "the fused Triton kernel in every graph (default: Triton from 16 sequences), split = "
                         "split-KV decode at every batch, cudacore = FlashInfer's CUDA-core decode kernel, "
                         "rowmajor = projection weights row-major; else the defaults")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--parts", default="gemm,forward,accuracy", help="of gemm, forward, accuracy; merged into --out")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    t_begin = time.time()
    dev, gen = "cuda", torch.Generator().manual_seed(0)
    r: dict = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            r = json.load(f)
    r.update({"device": torch.cuda.get_device_name(), "torch": torch.__version__, f"args_{args.parts}": vars(args)})

    def save():
        r["elapsed_s"] = time.time() - t_begin
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)

    cfg = LlamaConfig.from_hf(SHAPE)
    if "gemm" in parts:
        r["hbm_copy_GBps"] = copy_bandwidth(dev) / 1e9
        r["hbm_read_GBps"] = read_bandwidth(dev) / 1e9
        print(f"copy {r['hbm_copy_GBps']:.0f} GB/s, read {r['hbm_read_GBps']:.0f} GB/s", flush=True)
        d = cfg.head_dim
        r["gemm"] = gemm_sweep(dev, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * d,
                               cfg.num_kv_heads * d, cfg.vocab_size)
        print("gemm         m   µs/GBps: linear | swapped | [K,N] weights | cuBLASLt", flush=True)
        for g in r["gemm"]:
            print(f"{g['gemm']:8s} {g['m']:5d} " + " | ".join(
                f"{g[f + '_us']:7.1f} {g[f + '_GBps']:5.0f}" for f in ("linear", "swapped", "kn", "lt") if f + "_us" in g),
                flush=True)
        r["kv_store"] = store_sweep(dev)
        print("kv store", json.dumps(r["kv_store"]), flush=True)
        save()
    if not parts & {"forward", "accuracy"}:
        return
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for p in model.parameters():  # random weights: the speed does not depend on their values
        p.requires_grad_(False)
    model.lm_head.weight = model.model.embed_tokens.weight
    set_weight_layout(model, column_major=True)  # as from_pretrained on CUDA
    model.eval()
    r["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    batches = tuple(int(b) for b in args.batches.split(","))
    kinds = args.kinds.split(",")
    r.setdefault("forward", {})
    for variant in args.variants.split(",") if "forward" in parts else ():
        kind, _, opt = variant.partition("/")
        attn_flashinfer.GRAPH_DECODE_TENSOR_CORES = opt != "cudacore"
        attn_flashinfer.GRAPH_DECODE_NO_SPLIT_FROM = 1 << 30 if opt == "split" else DEFAULT_NO_SPLIT_FROM
        set_weight_layout(model, column_major=opt != "rowmajor")
        t0 = time.time()
        graph_attention = {"fi-graphs": "flashinfer", "triton": "triton"}.get(opt, "auto")
        eng = KVCacheEngine(model, EngineConfig(page_size=16, kv_cache_bytes=4 * GIB, max_num_seqs=64,
                                                attention="flashinfer", kernels=kind, graph_batch_sizes=batches,
                                                graph_attention=graph_attention))
        init_s = time.time() - t0
        rows = [device_breakdown(eng, b, args.ctx, gen) for b in batches]
        r["forward"][variant] = {"engine_init_s": init_s, "rows": rows}
        attn_flashinfer.GRAPH_DECODE_TENSOR_CORES, attn_flashinfer.GRAPH_DECODE_NO_SPLIT_FROM = DEFAULTS
        set_weight_layout(model, column_major=True)
        print(variant, f"init {init_s:.1f}s", " ".join(f"b{x['batch']}: fwd {x['forward_ms']:.3f} ms head+sample "
                                                     f"{x['lm_head_sample_ms']:.3f} ms" for x in rows), flush=True)
        if variant == "flashinfer":
            r["profile"] = [profile_replay(eng, b, args.ctx, gen) for b in (1, 16)]
            for p in r["profile"]:
                print(f"profile b{p['batch']}: {p['launches_per_step']:.0f} launches, "
                      f"{p['kernel_us_per_step']:.0f} µs of kernels per step", flush=True)
                for row in p["top"][:12]:
                    print(f"  {row['us_per_step']:8.1f} µs {row['launches_per_step']:5.0f}x  {row['kernel']}", flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
        save()
    if "accuracy" not in parts:
        return
    ref_model = copy.deepcopy(model).float()
    ref_model.lm_head.weight = ref_model.model.embed_tokens.weight
    r["accuracy"] = accuracy(model, ref_model, kinds, gen)
    print("accuracy", json.dumps(r["accuracy"]), flush=True)
    del ref_model
    save()


if __name__ == "__main__":
    main()
