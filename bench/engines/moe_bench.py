"""Routed experts of one decode pass: the Triton decode kernels (services/engines/moe_triton.py)
against torch._grouped_mm, inside ``grouped_experts`` (routing excluded), each call replayed as a
CUDA graph on cold weights (a rotation of ``--layers`` layers' experts, more than the L2 holds, as
a pass meets them). Rows of random tokens with distinct top-k experts; the Qwen3-Omni Thinker's
shapes by default. ``--sweep``: the kernels' launch configurations at each size as well.

    python bench/engines/moe_bench.py --out moe_bench.json [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from gpu_timing import graph_replay_ms

from mstar.models.qwen3_omni import layers
from mstar.services.engines import moe_triton


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inner", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--layers", type=int, default=4, help="layers' experts rotated through (1.2 GB a layer)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    e, h, i, k = args.experts, args.hidden, args.inner, args.top_k
    weights = [(torch.randn(e, 2 * i, h, device=dev, dtype=bf) * h ** -0.5,
                torch.randn(e, h, i, device=dev, dtype=bf) * i ** -0.5) for _ in range(args.layers)]
    configs = [(moe_triton.BLOCK_N, moe_triton.BLOCK_K, moe_triton.NUM_WARPS, moe_triton.NUM_STAGES)]
    if args.sweep:
        configs += [c for c in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4)) if c != configs[0]]
    result = {"gpu": torch.cuda.get_device_name(), "shape": {"experts": e, "hidden": h, "inner": i, "top_k": k},
              "rows": []}
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, h, device=dev, dtype=bf)
        index = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(rows)])
        weight = torch.rand(rows, k, device=dev, dtype=bf)

        def run(kernels, x=x, index=index, weight=weight):
            def fn():
                for gu, dn in weights:
                    layers.grouped_experts(x, index, weight, gu, dn, kernels=kernels)
            return fn

        base = graph_replay_ms(run(layers.GroupedGemms), args.iters) / args.layers
        ref = layers.grouped_experts(x, index, weight, *weights[0], kernels=layers.GroupedGemms).float()
        row = {"rows": rows, "grouped_mm_us": base * 1e3, "triton": []}
        for bn, bk, warps, stages in configs:
            moe_triton.BLOCK_N, moe_triton.BLOCK_K, moe_triton.NUM_WARPS, moe_triton.NUM_STAGES = bn, bk, warps, stages
            cfg = {"block_n": bn, "block_k": bk, "warps": warps, "stages": stages}
            try:
                got = layers.grouped_experts(x, index, weight, *weights[0], kernels=moe_triton).float()
                cfg["rel_err"] = float((got - ref).abs().max() / ref.abs().max())
                cfg["us"] = graph_replay_ms(run(moe_triton), args.iters) / args.layers * 1e3
            except Exception as ex:  # a configuration past the shared memory: recorded, skipped
                cfg["error"] = f"{type(ex).__name__}: {ex}"[:200]
            row["triton"].append(cfg)
        moe_triton.BLOCK_N, moe_triton.BLOCK_K, moe_triton.NUM_WARPS, moe_triton.NUM_STAGES = configs[0]
        best = min((c for c in row["triton"] if "us" in c), key=lambda c: c["us"])
        print(f"rows {rows:3d}: grouped_mm {row['grouped_mm_us']:7.1f} us  triton default {row['triton'][0]['us']:7.1f} us"
              f"  best {best['us']:7.1f} us ({best['block_n']}/{best['block_k']}/{best['warps']}/{best['stages']})",
              flush=True)
        result["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)



if __name__ == "__main__":
    main()
