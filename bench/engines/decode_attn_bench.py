"""Decode attention of a whole step, kernels alone: the fused Triton kernel (RoPE + K/V store +
attention, ``attn_triton.py``) under launch configurations, against FlashInfer's graph decode
(+ its RoPE kernel + the K/V store) as the engine ran it before. 28 layers of a Llama-3.2-3B
shape (24/8 heads, d 128, page 16, bf16), each layer its own cache (so L2 does not hold one
layer's KV across calls), captured in one CUDA graph per variant; CUDA-event medians.

    python bench/engines/decode_attn_bench.py --out decode_attn.json [--configs 64x4,128x4,...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from gpu_timing import graph_replay_ms

from mstar.services.engines import attn_triton
from mstar.services.engines.attention import AttentionBatch, HeadShape
from mstar.services.engines.attn_flashinfer import WORKSPACE_BYTES, FlashInferGraphDecode
from mstar.services.engines.kernels import FlashInferOps
from mstar.services.engines.layers import RotaryEmbedding
from mstar.services.engines.pages import build_csr

HEADS, LAYERS, PS = HeadShape(24, 8, 128), 28, 16


def graph_ms(fn, reps: int = 30) -> float:
    return graph_replay_ms(fn, reps)


def run_case(bs: int, ctx: int, configs: list[str], rope, cos_sin, ops, gen) -> dict:
    dev, dt, h, d = torch.device("cuda"), torch.bfloat16, HEADS, HEADS.head_dim
    pages_per = -(-ctx // PS)
    num_pages = 1 + bs * pages_per
    kv = torch.randn(LAYERS, 2, num_pages, PS, h.num_kv_heads, d, device=dev, dtype=dt, generator=gen)
    perm = (torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(bs)) + 1).tolist()
    lists = [perm[i * pages_per:(i + 1) * pages_per] for i in range(bs)]
    table = build_csr(lists, [ctx] * bs, PS)
    slots = torch.tensor([lst[(ctx - 1) // PS] * PS + (ctx - 1) % PS for lst in lists], device=dev)
    batch = AttentionBatch(torch.arange(bs + 1, dtype=torch.int32), table, slots.cpu())
    positions = torch.full((bs,), ctx - 1, device=dev)
    qkv = torch.randn(LAYERS, bs, (h.num_qo_heads + 2 * h.num_kv_heads) * d, device=dev, dtype=dt, generator=gen)
    views = []
    for lay in range(LAYERS):
        q, k, v = qkv[lay].split([h.num_qo_heads * d, h.num_kv_heads * d, h.num_kv_heads * d], dim=-1)
        views.append((q.view(bs, h.num_qo_heads, d), k.view(bs, h.num_kv_heads, d), v.view(bs, h.num_kv_heads, d)))
    row = {"batch": bs, "ctx": ctx}
    fi = FlashInferGraphDecode(h, dev, dt, PS, bs, num_pages,
                               torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev))
    fi.plan(batch)

    def fi_step():
        for lay, (q, k, v) in enumerate(views):
            q, k = ops.rope(rope, q, k, positions)
            ops.store_kv(kv[lay], slots, k, v)
            fi.run(q, kv[lay][0], kv[lay][1])

    row["flashinfer_split_kv"] = fi.split_kv
    row["flashinfer_rope_store_attn_us"] = graph_ms(fi_step) * 1e3 / LAYERS
    tri = attn_triton.TritonGraphDecode(h, dev, dt, PS, bs, num_pages)
    tri.plan(batch)
    for cfg in configs:
        bn, nw, ns, *sp = map(int, cfg.split("x"))
        tri.block_n, tri.num_warps, tri.num_stages = bn, nw, ns or None
        tri.set_splits(sp[0] if sp else 1)
        tri.plan(batch)  # the step's split count follows the graph's (splits_for_context)
        row[f"triton_{cfg}_active_splits"] = int(tri._indptr[-1])

        def tri_step():
            for lay, (q, k, v) in enumerate(views):
                tri.run_rope_store(q, k, v, positions, slots, kv[lay], cos_sin)

        try:
            row[f"triton_{cfg}_us"] = graph_ms(tri_step) * 1e3 / LAYERS
        except Exception as e:  # a configuration that does not compile (registers, shared memory)
            row[f"triton_{cfg}_us"] = None
            row[f"triton_{cfg}_error"] = repr(e)[:300]
    default = attn_triton.TritonGraphDecode(h, dev, dt, PS, bs, num_pages)
    tri.block_n, tri.num_warps, tri.num_stages = default.block_n, default.num_warps, default.num_stages
    tri.set_splits(default.splits)
    tri.plan(batch)
    row["triton_default"] = f"{tri.block_n}x{tri.num_warps}x{tri.num_stages or 0}x{tri.splits}"

    def tri_default():
        for lay, (q, k, v) in enumerate(views):
            tri.run_rope_store(q, k, v, positions, slots, kv[lay], cos_sin)

    row["triton_default_fused_us"] = graph_ms(tri_default) * 1e3 / LAYERS
    row["flashinfer_over_triton_default"] = row["flashinfer_rope_store_attn_us"] / row["triton_default_fused_us"]

    def tri_attn_only():  # the kernel without RoPE and the store (its prologue's share)
        for lay, (q, _, _) in enumerate(views):
            tri.run(q, kv[lay][0], kv[lay][1])

    row["triton_default_attention_only_us"] = graph_ms(tri_attn_only) * 1e3 / LAYERS
    best = min((v, k) for k, v in row.items() if k.startswith("triton_") and k.endswith("_us") and v
               and "attention_only" not in k and "default" not in k)
    row["best_triton"] = best[1]
    row["flashinfer_over_best_triton"] = row["flashinfer_rope_store_attn_us"] / best[0]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="1x192,4x192,8x192,16x192,32x192,64x192,1x1024,8x1024,16x1024,64x1024,"
                                       "1x4096,4x4096,16x4096")
    ap.add_argument("--configs", default="64x4x0,32x4x0,128x4x0,128x8x0,256x8x0,64x4x1,64x4x2,64x4x3,128x8x2,64x2x0",
                    help="BLOCK_N x num_warps x num_stages (0: Triton's default) [x KV splits, default 1]")
    args = ap.parse_args()
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    rope = RotaryEmbedding(HEADS.head_dim, 500000.0, max_positions=8192)
    cos_sin = rope.cos_sin_cache(dev)
    ops = FlashInferOps()
    r = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "cases": []}
    t_begin = time.time()
    for case in args.cases.split(","):
        bs, ctx = map(int, case.split("x"))
        row = run_case(bs, ctx, args.configs.split(","), rope, cos_sin, ops, gen)
        print(json.dumps(row), flush=True)
        r["cases"].append(row)
        torch.cuda.empty_cache()
        r["elapsed_s"] = time.time() - t_begin
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
