"""The fused-norm decode graphs' down projection + residual add (``h += x @ w.T``, Llama-3.2-3B:
N 3072, K 8192) at decode batch sizes: the Triton kernel (``gemm_triton.linear_add_``) under
launch configurations against cuBLAS ``h.addmm_(x, w.t())`` on the
column-major weight (what the graphs ran before) and on the row-major one. 28 weight copies, one
per layer, in one CUDA graph (L2 holds none across calls); µs per GEMM, medians.

    python bench/engines/down_gemm_bench.py --out down_gemm.json [--ms 1,16,32] [--block-n 32,64 ...]
"""

from __future__ import annotations

import argparse
import time

import torch
from gpu_timing import add_grid_args, config_grid, record_row, sweep
from skinny_gemm_bench import LAYERS, SHAPES, graph_us

from mstar.services.engines import gemm_triton

N, K = SHAPES["down"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16,32")
    add_grid_args(ap, block_n="32,64", block_k="128,256", stages="4,6", warps="4")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    r = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
         "default_configs": {str(k): v for k, v in gemm_triton.CONFIGS.items()}, "rows": []}
    t0 = time.time()
    configs = config_grid(args, ("block_n", "block_k", "stages", "warps"))
    ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
    wcm = [w.t().contiguous().t() for w in ws]  # column-major, as set_weight_layout stores them on CUDA
    for m in map(int, args.ms.split(",")):
        x = torch.randn(m, K, device=dev, dtype=dt)
        h0 = torch.randn(m, N, device=dev, dtype=dt)
        h = h0.clone()
        want = h0.float() + x.float() @ ws[0].float().T
        row = {"m": m, "weight_MB": N * K * 2 / 1e6,
               "cublas_colmajor_us": graph_us(lambda: [h.addmm_(x, w.t()) for w in wcm]),  # noqa: B023
               "cublas_rowmajor_us": graph_us(lambda: [h.addmm_(x, w.t()) for w in ws])}  # noqa: B023
        row["triton_default_us"] = graph_us(lambda: [gemm_triton.linear_add_(h, x, w) for w in ws])  # noqa: B023

        def run(cfg, x=x, h0=h0):
            out = gemm_triton.linear_add_(h0.clone(), x, ws[0], config=cfg)
            hh = h0.clone()
            return out, graph_us(lambda: [gemm_triton.linear_add_(hh, x, w, config=cfg) for w in ws])

        best = sweep(row, "triton_", configs, run, want)
        if best:
            row["best_triton"], row["best_triton_us"] = best[1], best[0]
            row["cublas_colmajor_over_best_triton"] = row["cublas_colmajor_us"] / best[0]
            row["best_triton_GBps"] = N * K * 2 / (best[0] * 1e-6) / 1e9
        record_row(r, row, args.out, t0, show=lambda key: not key.startswith("triton_") or "default" in key)


if __name__ == "__main__":
    main()
