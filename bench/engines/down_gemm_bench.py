"""The fused-norm decode graphs' Triton GEMMs at decode batch sizes (Llama-3.2-3B shapes), under
launch configurations, against what cuBLAS runs in their place. 28 weight copies, one per layer,
in one CUDA graph (L2 holds none across calls); µs per layer, medians.

- ``--op down``: the down projection + residual add ``h += x @ w.T`` (N 3072, K 8192),
  ``gemm_triton.linear_add_``, against cuBLAS ``h.addmm_(x, w.t())`` on the column-major weight
  (what the graphs ran before) and on the row-major one.
- ``--op gate_up``: gate/up + SiLU·mul + the row's RMSNorm scale (2I 16384, K 3072) as one
  Triton kernel (``gate_up_silu`` below: each program owns BLOCK_N columns of gate and the same
  of up, sums each row's squares from the input tiles its K loop loads anyway, and writes
  silu(r·gate)·(r·up)), against cuBLAS' GEMM on the column-major weight followed by
  ``rowscale_triton.silu_mul_rowscale`` (the graphs' pair), and the cuBLAS GEMM alone. Tried in
  the engine and not adopted (bench/results/engines/2026-11-25d/: 38.8 vs 38.2 µs a layer at 16
  rows, the decode step 0.3% slower at batch 16 and 3.5% at 32).

    python bench/engines/down_gemm_bench.py --out down_gemm.json [--op gate_up] [--ms 1,16,32] [--block-n 32,64 ...]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
from gpu_timing import add_grid_args, config_grid, record_row, sweep
from skinny_gemm_bench import LAYERS, SHAPES, graph_us

from mstar.services.engines import gemm_triton
from mstar.services.engines.rowscale_triton import silu_mul_rowscale, silu_mul_rowscale_ref

EPS = 1e-5
#: gate_up_silu's launch configuration per row tile: (BLOCK_N, BLOCK_K, stages, warps); the best of
#: the sweep in bench/results/engines/2026-11-25d/gate_up_gemm.json.
GATE_UP_CONFIGS = {16: (64, 128, 3, 4), 32: (64, 128, 3, 4)}


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, M, INTER, K, stride_xm, stride_wn, stride_om, eps,
                         BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.arange(0, BM)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BM], dtype=tl.float32)
    nmask = rn[:, None] < INTER
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        kmask = kk[None, :] < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & kmask, other=0.0)
        wg = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=nmask & kmask, other=0.0)
        wu = tl.load(w_ptr + (rn[:, None] + INTER) * stride_wn + kk[None, :], mask=nmask & kmask, other=0.0)
        xf = x.to(tl.float32)
        squares += tl.sum(xf * xf, 1)
        if x.dtype == tl.float32:
            gate += tl.dot(x, tl.trans(wg), input_precision="ieee")
            up += tl.dot(x, tl.trans(wu), input_precision="ieee")
        else:
            gate += tl.dot(x, tl.trans(wg))
            up += tl.dot(x, tl.trans(wu))
    r = 1.0 / tl.sqrt(squares / K + eps)
    g = gate * r[:, None]
    act = g / (1.0 + tl.exp(-g)) * (up * r[:, None])
    mask = (rm[:, None] < M) & (rn[None, :] < INTER)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], act.to(out_ptr.dtype.element_ty), mask=mask)


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, eps: float, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """silu(r · x @ w_gate.T) · (r · x @ w_up.T) [M, I] with r = 1 / sqrt(mean(x²) + eps) per row:
    x [M, K] un-normalised rows (the RMSNorm weight folded into ``w``), w [2I, K] row-major
    (gate rows, then up rows), M <= gemm_triton.MAX_ROWS. Dot products in fp32 (not rounded before the
    activation), one rounding to x's dtype. ``config`` as ``linear_add_``'s."""
    m, k = x.shape
    two_i = w.shape[0]
    if m > gemm_triton.MAX_ROWS:
        raise ValueError(f"gate_up_silu takes at most {gemm_triton.MAX_ROWS} rows, got {m}")
    if w.shape[1] != k or two_i % 2 or w.stride(1) != 1 or x.stride(1) != 1 or x.dtype != w.dtype:
        raise ValueError(f"need x [M, K] and w [2I, K] row-major, one dtype; got x {tuple(x.shape)} {x.dtype}, "
                         f"w {tuple(w.shape)} {w.dtype} strides {w.stride()}")
    inter = two_i // 2
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    bm = max(16, triton.next_power_of_2(m))
    block_n, block_k, stages, warps = config or GATE_UP_CONFIGS[bm]
    _gate_up_silu_kernel[(triton.cdiv(inter, block_n),)](
        x, w, out, m, inter, k, x.stride(0), w.stride(0), out.stride(0), eps,
        BM=bm, BLOCK_N=block_n, BLOCK_K=block_k, num_stages=stages, num_warps=warps)
    return out


def down_row(m: int, ws, wcm, configs, dev, dt) -> tuple[dict, tuple[float, str] | None]:
    n, k = SHAPES["down"]
    x = torch.randn(m, k, device=dev, dtype=dt)
    h0 = torch.randn(m, n, device=dev, dtype=dt)
    h = h0.clone()
    want = h0.float() + x.float() @ ws[0].float().T
    row = {"m": m, "weight_MB": n * k * 2 / 1e6,
           "cublas_colmajor_us": graph_us(lambda: [h.addmm_(x, w.t()) for w in wcm]),
           "cublas_rowmajor_us": graph_us(lambda: [h.addmm_(x, w.t()) for w in ws]),
           "triton_default_us": graph_us(lambda: [gemm_triton.linear_add_(h, x, w) for w in ws])}

    def run(cfg):
        out = gemm_triton.linear_add_(h0.clone(), x, ws[0], config=cfg)
        hh = h0.clone()
        return out, graph_us(lambda: [gemm_triton.linear_add_(hh, x, w, config=cfg) for w in ws])

    return row, sweep(row, "triton_", configs, run, want)


def gate_up_row(m: int, ws, wcm, configs, dev, dt) -> tuple[dict, tuple[float, str] | None]:
    two_i, k = SHAPES["gate_up"]
    x = torch.randn(m, k, device=dev, dtype=dt) * 3  # un-normalised rows
    want = silu_mul_rowscale_ref(x.float() @ ws[0].float().T, x.float(), EPS)
    row = {"m": m, "weight_MB": two_i * k * 2 / 1e6,
           "cublas_gemm_only_us": graph_us(lambda: [x @ w.t() for w in wcm]),
           "cublas_colmajor_us": graph_us(lambda: [silu_mul_rowscale(x @ w.t(), x, EPS) for w in wcm]),
           "triton_default_us": graph_us(lambda: [gate_up_silu(x, w, EPS) for w in ws])}

    def run(cfg):
        out = gate_up_silu(x, ws[0], EPS, config=cfg)
        return out, graph_us(lambda: [gate_up_silu(x, w, EPS, config=cfg) for w in ws])

    return row, sweep(row, "triton_", configs, run, want)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--op", default="down", choices=("down", "gate_up"))
    ap.add_argument("--ms", default="1,16,32")
    add_grid_args(ap, block_n="32,64", block_k="128,256", stages="4,6", warps="4")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    defaults = gemm_triton.CONFIGS if args.op == "down" else GATE_UP_CONFIGS
    r = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
         "default_configs": {str(k): v for k, v in defaults.items()}, "rows": []}
    t0 = time.time()
    configs = config_grid(args, ("block_n", "block_k", "stages", "warps"))
    n, k = SHAPES[args.op]
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
    wcm = [w.t().contiguous().t() for w in ws]  # column-major, as set_weight_layout stores them on CUDA
    for m in map(int, args.ms.split(",")):
        row, best = (down_row if args.op == "down" else gate_up_row)(m, ws, wcm, configs, dev, dt)
        if best:
            row["best_triton"], row["best_triton_us"] = best[1], best[0]
            row["cublas_colmajor_over_best_triton"] = row["cublas_colmajor_us"] / best[0]
            row["best_triton_GBps"] = n * k * 2 / (best[0] * 1e-6) / 1e9
        record_row(r, row, args.out, t0, show=lambda key: not key.startswith("triton_") or "default" in key)


if __name__ == "__main__":
    main()
