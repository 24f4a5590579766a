"""Skinny GEMMs split over K, reduced in the same launch: ``x [M, K] @ w.T`` for a few dozen rows.

At 50-200 rows (π0.5's action expert: 50 action tokens a sequence) cuBLAS runs a layer's
projections at a third to a half of the HBM rate: few output tiles (o_proj and down have N = 1024)
leave most SMs idle, or a split-K GEMM writes partial sums for a second reduction kernel. Here a
program owns a BLOCK_N-column tile of the output for BM rows and one of SPLITS slices of K; it
streams its slice of ``w`` through a software pipeline. With several splits each program writes its
fp32 partial tile to a workspace and bumps its tile's counter; the last to arrive sums the tile's
partials, applies the epilogue and writes the output, then resets the counter (so a CUDA graph
replays it with no memset). Epilogues: none, or ``res + acc * gate`` (the adaRMS-gated residual
of the expert's o_proj and down; ``gate`` one row per ``rows_per_gate`` output rows).

On a CPU it runs under ``TRITON_INTERPRET=1`` (the tests), programs one after another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: (BM, BLOCK_N, BLOCK_K, stages, warps) and the programs a launch aims for (splits are chosen for it)
CONFIG = (64, 64, 128, 4, 4)
TARGET_PROGRAMS, MAX_SPLITS = 132, 8


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, out_ptr, res_ptr, gate_ptr, ws_ptr, cnt_ptr,
                   M, N, K, sxm, swn, som, srm, sgm, rows_per_gate, k_per_split, splits,
                   BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   GATED: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    lo = s * k_per_split
    hi = tl.minimum(lo + k_per_split, K)
    for k in range(lo, hi, BLOCK_K):
        kk = k + rk
        x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < hi), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * swn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < hi), other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        tile = pid_m * tl.num_programs(0) + pid_n
        cell = tl.arange(0, BM)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(ws_ptr + (s * tl.num_programs(0) * tl.num_programs(2) + tile) * BM * BLOCK_N + cell, acc)
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == splits - 1:  # the tile's last split: sum the others' partials into its own
            for t in range(0, splits):
                if t != s:
                    acc += tl.load(ws_ptr + (t * tl.num_programs(0) * tl.num_programs(2) + tile) * BM * BLOCK_N + cell,
                                   cache_modifier=".cg")
            tl.store(cnt_ptr + tile, 0)
            _epilogue(acc, out_ptr, res_ptr, gate_ptr, rm, rn, mask, som, srm, sgm, rows_per_gate, GATED)
    else:
        _epilogue(acc, out_ptr, res_ptr, gate_ptr, rm, rn, mask, som, srm, sgm, rows_per_gate, GATED)


@triton.jit
def _epilogue(acc, out_ptr, res_ptr, gate_ptr, rm, rn, mask, som, srm, sgm, rows_per_gate, GATED: tl.constexpr):
    if GATED:
        gate = tl.load(gate_ptr + (rm // rows_per_gate)[:, None] * sgm + rn[None, :], mask=mask, other=0.0)
        res = tl.load(res_ptr + rm[:, None] * srm + rn[None, :], mask=mask, other=0.0)
        acc = res.to(tl.float32) + acc * gate.to(tl.float32)
    tl.store(out_ptr + rm[:, None] * som + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 counter per output tile, kept zero by the kernel (the last split resets it):
    one buffer per (device, stream), since launches on one stream never overlap, grown as needed.
    The first call on a stream must come before any graph capture on it (the engines warm up first)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def splits_for(tiles: int, k: int, block_k: int) -> int:
    """K splits: enough programs for about TARGET_PROGRAMS, at most MAX_SPLITS, a BLOCK_K at least each."""
    return max(1, min(-(-TARGET_PROGRAMS // tiles), MAX_SPLITS, k // block_k))


def linear(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None, gate: torch.Tensor | None = None,
           rows_per_gate: int = 1, *, config: tuple[int, ...] | None = None, splits: int | None = None) -> torch.Tensor:
    """``x [M, K] @ w.T`` (w [N, K] row-major) -> [M, N] in x's dtype, sums in fp32, one rounding; with
    ``res`` [M, N] and ``gate`` [M // rows_per_gate, N]: ``res + (x @ w.T) * gate`` (output row m takes
    gate row m // rows_per_gate). ``config`` (BM, BLOCK_N, BLOCK_K, stages, warps) / ``splits``: instead of
    ``CONFIG`` / ``splits_for`` (benchmarks)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1 or x.dtype != w.dtype:
        raise ValueError(f"need x [M, K] @ w [N, K].T, one dtype, unit inner strides; got x {tuple(x.shape)} {x.dtype}, "
                         f"w {tuple(w.shape)} {w.dtype} strides {x.stride()} / {w.stride()}")
    gated = res is not None
    if gated and (gate is None or res.shape != (m, n) or res.stride(1) != 1 or gate.stride(-1) != 1
                  or gate.shape[-1] != n or gate.shape[0] * rows_per_gate < m):
        raise ValueError(f"need res [M, N] and gate [M / rows_per_gate, N] with unit inner strides; got res "
                         f"{None if res is None else tuple(res.shape)}, gate {None if gate is None else tuple(gate.shape)}")
    bm, block_n, block_k, stages, warps = config or CONFIG
    tiles_n, tiles_m = triton.cdiv(n, block_n), triton.cdiv(m, bm)
    n_splits = splits or splits_for(tiles_n * tiles_m, k, block_k)
    per_split = triton.cdiv(triton.cdiv(k, n_splits), block_k) * block_k
    n_splits = triton.cdiv(k, per_split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split = n_splits > 1
    ws = torch.empty(n_splits * tiles_n * tiles_m * bm * block_n, dtype=torch.float32, device=x.device) if split else out
    cnt = _counters(x.device, tiles_n * tiles_m) if split else out
    res_, gate_ = (res, gate) if gated else (out, out)
    _splitk_kernel[(tiles_n, n_splits, tiles_m)](
        x, w, out, res_, gate_, ws, cnt, m, n, k, x.stride(0), w.stride(0), out.stride(0), res_.stride(0),
        gate_.stride(0), rows_per_gate, per_split, n_splits,
        BM=bm, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, GATED=gated, IEEE=x.dtype == torch.float32,
        num_stages=stages, num_warps=warps)
    return out
