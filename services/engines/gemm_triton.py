"""Skinny GEMMs for decode steps without norm kernels (``ForwardContext.fused_norms``), as Triton
kernels: the down projection and o_proj with their residual add, ``h += x @ w.T`` (``linear_add_``),
and qkv, ``x @ w.T`` (``linear``), for a few rows.

cuBLAS runs the down shape (a handful of rows, K = 8192, N = 3072 for Llama-3.2-3B) as a split-K GEMM
plus a separate reduction kernel. Here each program owns BLOCK_N output columns for all rows,
streams its rows of ``w`` (row-major [N, K]: contiguous BLOCK_K runs) through a software
pipeline, accumulates in fp32 and adds into ``h`` in its epilogue: one launch, no partial sums in
memory. On an H100 at 16 rows (bench/results/engines/2026-11-25c/step_trace-tdown.json) it takes
21.3 µs a layer against cuBLAS' 19.9 + 2.1 µs for the reduction + 0.7 µs between the two. For qkv
and o_proj the kernel alone is no faster than cuBLAS; what it adds is programmatic dependent launch
(pdl.py): the next kernel may launch once the K loop is done, which cuBLAS never allows. On a CPU
it runs under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.services.engines.pdl import gdc_launch_dependents, gdc_wait, launch_options

#: Most rows the decode graphs give the kernel (its row tile is the next power of two >= 16 of the
#: rows). In the engine on an H100 (bench/results/engines/2026-11-25c/decode_bench-down-ab.json) it
#: beat cuBLAS' split-K GEMM + reduction by 1.5-3.5% of a step at 1-32 rows and lost 1.4% at 64.
MAX_ROWS = 32
#: Launch configuration per row tile: (BLOCK_N, BLOCK_K, pipeline stages, warps). On an H100
#: (skinny_gemm_m16_sweep.json) 32 x 256 with 6 stages gave 21.0 µs at 16 rows.
CONFIGS = {16: (32, 256, 6, 4), 32: (32, 256, 6, 4)}
#: For outputs of at least WIDE_N columns (qkv: 5,120): 64 x 256, 4 stages gave 13.7 µs at 16 rows
#: (bench/results/engines/2026-11-25e/packed_gemm.json, row-major).
WIDE_N = 4096
WIDE_CONFIGS = {16: (64, 256, 4, 4), 32: (64, 256, 4, 4)}


@triton.jit
def _linear_kernel(x_ptr, w_ptr, h_ptr, M, N, K, stride_xm, stride_wn, stride_hm,
                   BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ADD: tl.constexpr,
                   PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """h = x @ w.T, or h += x @ w.T with ADD. PDL: a programmatic dependent of the kernel that
    wrote x (pdl.py); TRIGGER: let this kernel's own dependents launch once the K loop is done."""
    if PDL:
        gdc_wait()
    rm = tl.arange(0, BM)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        if x.dtype == tl.float32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if TRIGGER:
        gdc_launch_dependents()  # they wait for this kernel's end before reading h
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    at = h_ptr + rm[:, None] * stride_hm + rn[None, :]
    if ADD:
        acc += tl.load(at, mask=mask, other=0.0).to(tl.float32)
    tl.store(at, acc.to(h_ptr.dtype.element_ty), mask=mask)


def _check(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"the Triton GEMM takes at most {MAX_ROWS} rows, got {m}")
    if (w.shape[1] != k or h.shape != (m, n) or w.stride(1) != 1 or x.stride(1) != 1 or h.stride(1) != 1
            or not h.dtype == x.dtype == w.dtype):
        raise ValueError(f"need h [M, N] += x [M, K] @ w [N, K].T, one dtype, unit inner strides; got h "
                         f"{tuple(h.shape)} {h.dtype}, x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype} "
                         f"strides {w.stride()}")


def _launch(h, x, w, add: bool, config, pdl: bool, trigger: bool) -> torch.Tensor:
    _check(h, x, w)
    m, k = x.shape
    n = w.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    block_n, block_k, stages, warps = config or (WIDE_CONFIGS if n >= WIDE_N else CONFIGS)[bm]
    _linear_kernel[(triton.cdiv(n, block_n),)](
        x, w, h, m, n, k, x.stride(0), w.stride(0), h.stride(0),
        BM=bm, BLOCK_N=block_n, BLOCK_K=block_k, ADD=add, PDL=pdl, TRIGGER=trigger,
        num_stages=stages, num_warps=warps, **launch_options(pdl))
    return h


def linear_add_(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...] | None = None,
                pdl: bool = False, trigger: bool = False) -> torch.Tensor:
    """h [M, N] += x [M, K] @ w.T, w [N, K] row-major, M <= ``MAX_ROWS``; sums in fp32, one
    rounding to h's dtype (as ``h.addmm_(x, w.t())``). ``config``: (BLOCK_N, BLOCK_K, stages,
    warps) instead of ``CONFIGS``' (benchmarks). ``pdl``: launched as a programmatic dependent of
    the kernel ahead; ``trigger``: its own dependents may launch after its K loop (pdl.py). Returns h."""
    return _launch(h, x, w, True, config, pdl, trigger)


def linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...] | None = None, pdl: bool = False,
           trigger: bool = False) -> torch.Tensor:
    """x [M, K] @ w.T [N, K] row-major -> [M, N], M <= ``MAX_ROWS`` (fp32 sums, one rounding);
    ``config`` / ``pdl`` / ``trigger`` as ``linear_add_``."""
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(out, x, w, False, config, pdl, trigger)
