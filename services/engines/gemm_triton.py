"""Skinny GEMM for decode batch sizes in Triton: y[M, N] = x[M, K] @ w[N, K]^T with M <= 64.

At decode sizes a projection is a weight stream: the work is reading w once. Each program owns
``BLOCK_N`` output columns (rows of w, read as contiguous ``BLOCK_K`` runs) and, with ``SPLIT_K``
> 1, one slice of K whose partial sums it adds atomically into an fp32 output. Experimental:
``bench/engines/skinny_gemm_bench.py`` compares it with cuBLAS (F.linear) per shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
