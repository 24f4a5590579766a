"""Decode-size projections of the Llama-3.2-3B shape: a Triton skinny GEMM (below; each program
owns BLOCK_N output columns, reads its rows of w as contiguous BLOCK_K runs, and with SPLIT_K > 1
adds its K slice's partial sums atomically into an fp32 output) under launch configurations vs
cuBLAS through F.linear (weights column-major as the engine stores them, and row-major). 28
weight copies per shape, one per layer, in one CUDA graph (so L2 does not hold a weight across
calls); µs per GEMM, medians. A measurement only: the engine keeps cuBLAS (results in
bench/results/engines/README.md).

    python bench/engines/skinny_gemm_bench.py --out skinny_gemm.json
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gpu_timing import add_grid_args, config_grid, graph_replay_ms, record_row, sweep


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k0 = pid_k * k_per
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k in range(k0, tl.minimum(k0 + k_per, K), BLOCK_K):
        kk = k + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


def skinny_linear(x: torch.Tensor, w: torch.Tensor, block_n: int = 32, block_k: int = 256, split_k: int = 1,
                  num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [M, K] (rows dense), w [N, K] row-major -> x @ w.T [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"need x [M, {k}] and w [N, {k}] with unit inner strides, got {tuple(x.shape)} / "
                         f"{tuple(w.shape)} strides {x.stride()} / {w.stride()}")
    bm = max(16, triton.next_power_of_2(m))
    y = (torch.empty if split_k == 1 else torch.zeros)((m, n), device=x.device,
                                                        dtype=x.dtype if split_k == 1 else torch.float32)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n), split_k)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BM=bm, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages)
    return y if split_k == 1 else y.to(x.dtype)


SHAPES = {"qkv": (5120, 3072), "o_proj": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)}
LAYERS = 28


def graph_us(fn, reps: int = 20) -> float:
    return graph_replay_ms(fn, reps) * 1e3 / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16,64")
    add_grid_args(ap, block_n="16,32,64", block_k="256,512", split_k="1,2,4", stages="4", warps="4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    r = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "rows": []}
    t0 = time.time()
    configs = config_grid(args, ("block_n", "block_k", "split_k", "stages", "warps"))
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
        wcm = [w.t().contiguous().t() for w in ws]  # column-major, as set_weight_layout stores them on CUDA
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = F.linear(x, ws[0]).float()
            row = {"gemm": name, "m": m, "weight_MB": n * k * 2 / 1e6,
                   "cublas_colmajor_us": graph_us(lambda: [F.linear(x, w) for w in wcm]),  # noqa: B023
                   "cublas_rowmajor_us": graph_us(lambda: [F.linear(x, w) for w in ws])}  # noqa: B023
            def run(cfg, x=x, ws=ws):
                bn, bk, sk, st, nw = cfg
                return (skinny_linear(x, ws[0], bn, bk, sk, nw, st),
                        graph_us(lambda: [skinny_linear(x, w, bn, bk, sk, nw, st) for w in ws]))

            best = sweep(row, "triton_", configs, run, ref)
            if best:
                row["best_triton"], row["best_triton_us"] = best[1], best[0]
                row["cublas_colmajor_over_best_triton"] = row["cublas_colmajor_us"] / best[0]
                row["best_triton_GBps"] = n * k * 2 / (best[0] * 1e-6) / 1e9
            row["cublas_colmajor_GBps"] = n * k * 2 / (row["cublas_colmajor_us"] * 1e-6) / 1e9
            record_row(r, row, args.out, t0, show=lambda key: not key.startswith("triton_"))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
