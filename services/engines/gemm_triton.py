"""The MLP's down projection with the residual add, for decode steps without norm kernels
(``ForwardContext.fused_norms``): ``h += x @ w.T`` for a few rows, as one Triton kernel.

cuBLAS runs this shape (a handful of rows, K = 8192, N = 3072 for Llama-3.2-3B) as a split-K GEMM
plus a separate reduction kernel. Here each program owns BLOCK_N output columns for all rows,
streams its rows of ``w`` (row-major [N, K]: contiguous BLOCK_K runs) through a software
pipeline, accumulates in fp32 and adds into ``h`` in its epilogue: one launch, no partial sums in
memory. On an H100 at 16 rows (bench/results/engines/2026-11-25c/step_trace-tdown.json) it takes
21.3 µs a layer against cuBLAS' 19.9 + 2.1 µs for the reduction + 0.7 µs between the two. On a CPU
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


#: The SiLU·mul + down projection kernel (``silu_linear_add_``) streams two activation tiles (gate,
#: up) a K step, so it keeps fewer stages in shared memory than ``CONFIGS``.
SILU_CONFIGS = {16: (32, 256, 5, 4), 32: (32, 256, 5, 4)}


@triton.jit
def _linear_kernel(x_ptr, w_ptr, h_ptr, M, N, K, stride_xm, stride_wn, stride_hm, ss_ptr, ss_count, eps,
                   BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ADD: tl.constexpr,
                   PDL: tl.constexpr, TRIGGER: tl.constexpr, SS_OUT: tl.constexpr, SILU: tl.constexpr,
                   NP: tl.constexpr):
    """h = x @ w.T, or h += x @ w.T with ADD.

    PDL: a programmatic dependent of the kernel that wrote x (pdl.py); TRIGGER: let this kernel's
    own dependents launch once the K loop is done. SS_OUT (with ADD): also write each row's sum of
    squares of h's new values in this program's columns to ``ss[row, program]`` (fp32, [M,
    programs]). SILU: ``x`` is [M, 2K], gate | up of un-normalised rows, and the operand is
    silu(r·gate)·(r·up), r = 1 / sqrt(sum(ss[row, :ss_count]) / h's columns + eps) per row (ss
    written by an SS_OUT kernel over h; NP: ss_count padded to a power of two)."""
    rm = tl.arange(0, BM)
    if SILU:  # ss is two kernels old: read before the wait
        p = tl.arange(0, NP)
        part = tl.load(ss_ptr + rm[:, None] * ss_count + p[None, :], mask=(rm[:, None] < M) & (p[None, :] < ss_count),
                       other=0.0)
        r = 1.0 / tl.sqrt(tl.sum(part, 1) / N + eps)
    if PDL:
        gdc_wait()
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        xmask = (rm[:, None] < M) & (kk[None, :] < K)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        if SILU:  # as rowscale_triton.silu_mul_rowscale: fp32, one rounding to the weight's dtype
            gate = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=xmask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + rm[:, None] * stride_xm + K + kk[None, :], mask=xmask, other=0.0).to(tl.float32)
            gate = gate * r[:, None]
            x = (gate / (1.0 + tl.exp(-gate)) * (up * r[:, None])).to(w.dtype)
        else:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=xmask, other=0.0)
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
    out = acc.to(h_ptr.dtype.element_ty)
    tl.store(at, out, mask=mask)
    if SS_OUT:
        v = tl.where(mask, out.to(tl.float32), 0.0)
        tl.store(ss_ptr + rm * ss_count + tl.program_id(0), tl.sum(v * v, 1), mask=rm < M)


def _check(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"linear_add_ takes at most {MAX_ROWS} rows, got {m}")
    if (w.shape[1] != k or h.shape != (m, n) or w.stride(1) != 1 or x.stride(1) != 1 or h.stride(1) != 1
            or not h.dtype == x.dtype == w.dtype):
        raise ValueError(f"need h [M, N] += x [M, K] @ w [N, K].T, one dtype, unit inner strides; got h "
                         f"{tuple(h.shape)} {h.dtype}, x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype} "
                         f"strides {w.stride()}")


def _launch(h, x, w, add: bool, config, pdl: bool, trigger: bool, k: int | None = None, ss=None,
            ss_out: bool = False, eps: float = 0.0) -> torch.Tensor:
    m = x.shape[0]
    n = w.shape[0]
    k = x.shape[1] if k is None else k
    bm = max(16, triton.next_power_of_2(m))
    block_n, block_k, stages, warps = config or (SILU_CONFIGS if ss is not None and not ss_out
                                                 else WIDE_CONFIGS if n >= WIDE_N else CONFIGS)[bm]
    grid = triton.cdiv(n, block_n)
    if ss_out:
        ss = torch.empty((m, grid), dtype=torch.float32, device=h.device)
    silu = ss is not None and not ss_out
    _linear_kernel[(grid,)](
        x, w, h, m, n, k, x.stride(0), w.stride(0), h.stride(0), h if ss is None else ss,
        0 if ss is None else ss.shape[1], eps,
        BM=bm, BLOCK_N=block_n, BLOCK_K=block_k, ADD=add, PDL=pdl, TRIGGER=trigger, SS_OUT=ss_out, SILU=silu,
        NP=triton.next_power_of_2(ss.shape[1]) if silu else 1,
        num_stages=stages, num_warps=warps, **launch_options(pdl))
    return ss if ss_out else h


def linear_add_(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...] | None = None,
                pdl: bool = False, trigger: bool = False) -> torch.Tensor:
    """h [M, N] += x [M, K] @ w.T, w [N, K] row-major, M <= ``MAX_ROWS``; sums in fp32, one
    rounding to h's dtype (as ``h.addmm_(x, w.t())``). ``config``: (BLOCK_N, BLOCK_K, stages,
    warps) instead of ``CONFIGS``' (benchmarks). ``pdl``: launched as a programmatic dependent of
    the kernel ahead; ``trigger``: its own dependents may launch after its K loop (pdl.py). Returns h."""
    _check(h, x, w)
    return _launch(h, x, w, True, config, pdl, trigger)


def linear_add_ss_(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, pdl: bool = False,
                   trigger: bool = False) -> torch.Tensor:
    """``linear_add_``, and returns each row's partial sums of squares of the updated ``h``
    (fp32 [M, programs], one per output column block) for ``silu_linear_add_``'s row scales."""
    _check(h, x, w)
    return _launch(h, x, w, True, None, pdl, trigger, ss_out=True)


def silu_linear_add_(h: torch.Tensor, gate_up: torch.Tensor, w: torch.Tensor, ss: torch.Tensor, eps: float,
                     config: tuple[int, ...] | None = None, pdl: bool = False, trigger: bool = False) -> torch.Tensor:
    """h [M, N] += (silu(r·gate) · (r·up)) @ w.T with gate_up [M, 2K] (gate | up of un-normalised
    rows), w [N, K] row-major and r = 1 / sqrt(mean(h²) + eps) per row from ``ss``, the partial sums
    ``linear_add_ss_`` returned for this ``h`` (before this call changes it). The SiLU·mul of
    ``rowscale_triton.silu_mul_rowscale`` computed on the way into the GEMM: no kernel, no
    activation in memory between them. Returns h."""
    m, two_k = gate_up.shape
    if two_k % 2 or ss.dim() != 2 or ss.shape[0] != m or ss.dtype != torch.float32 or not ss.is_contiguous():
        raise ValueError(f"need gate_up [M, 2K] and ss [M, parts] fp32 contiguous, got {tuple(gate_up.shape)} / "
                         f"{tuple(ss.shape)} {ss.dtype}")
    _check(h, gate_up[:, : two_k // 2], w)
    return _launch(h, gate_up, w, True, config, pdl, trigger, k=two_k // 2, ss=ss, eps=eps)


def linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...] | None = None, pdl: bool = False,
           trigger: bool = False) -> torch.Tensor:
    """x [M, K] @ w.T [N, K] row-major -> [M, N], M <= ``MAX_ROWS`` (fp32 sums, one rounding);
    ``config`` / ``pdl`` / ``trigger`` as ``linear_add_``."""
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    _check(out, x, w)
    return _launch(out, x, w, False, config, pdl, trigger)
