"""Routed experts at decode sizes as two Triton kernels, one program per (expert, output tile).

A decode pass of a mixture-of-experts layer sends a few rows to each expert (16 rows x top-8 over
128 experts: ~1.6 rows an expert, ~80 experts hit). Its cost is reading the hit experts' weights
once, so a kernel must stream them at the memory's rate with enough programs in flight. The
(token, expert) pairs are sorted by expert, ``ends[e]`` is where expert e's rows end (int32, the
grouped GEMMs' ``offs``); the program of (e, tile) loads its weight tile in ``BLOCK_K`` slices
and multiplies every row of e by it (16-row blocks for the tensor cores; an expert with more rows
loops over blocks), or returns at once when e has none.

- ``gate_up``: x [T, H], ``token`` [P] (the sorted pairs' rows of x), ``w`` [E, 2I, H] (gate rows
  first) -> h [P, I] = silu(x w_gate^T) * (x w_up^T), accumulated and multiplied in fp32, rounded once;
- ``down``: h [P, I], ``w`` [E, H, I] -> y [P, H].

Rows past ``ends[E - 1]`` (an expert-parallel rank's pairs of other ranks' experts) are not
written. Both are ``torch.library`` custom ops (``mstar::moe_gate_up``, ``mstar::moe_down``), so a
torch.compile'd caller calls them as they are. On a CPU they run under ``TRITON_INTERPRET=1``
(fp32), which the tests use against the per-expert loop. The kernels call no jit function, not even
``tl.zeros`` or ``tl.sigmoid`` (both are jit functions): under the interpreter, a jit function
decorated before ``TRITON_INTERPRET`` was set (Triton imported first by torch.compile) does not run.

On an H200 at the Qwen3-Omni Thinker's shapes: 0.65-0.71x torch._grouped_mm's time for a layer's
experts at 1-64 rows (``bench/engines/moe_bench.py``; ``bench/results/qwen3_omni/2026-11-27f-h200/``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: decode passes only: above this many (token, expert) pairs (prefills) the grouped GEMMs are used
#: (the compiled MoE piece branches here: models/qwen3_omni/layers.warm_compiled warms both sides)
MAX_PAIRS = 512
#: launch configuration (rows a block, output columns a tile, weight columns a slice, warps, stages)
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128
NUM_WARPS, NUM_STAGES = 4, 4


@triton.jit
def _gate_up_kernel(x_ptr, token_ptr, ends_ptr, w_ptr, h_ptr, HIDDEN, INNER,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    e = tl.program_id(0)
    end = tl.load(ends_ptr + e)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + e.to(tl.int64) * (2 * INNER * HIDDEN) + cols[:, None] * HIDDEN + ks[None, :]
    w_up = w_gate + INNER * HIDDEN
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        live = rows < end
        tok = tl.load(token_ptr + rows, mask=live, other=0).to(tl.int64)
        xs = x_ptr + tok[:, None] * HIDDEN + ks[None, :]
        gate = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        up = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            xk = tl.load(xs + k0, mask=live[:, None], other=0.0)
            if IEEE:  # fp32 (the interpreter's tests): no TF32 rounding
                gate = tl.dot(xk, tl.trans(tl.load(w_gate + k0)), gate, input_precision="ieee")
                up = tl.dot(xk, tl.trans(tl.load(w_up + k0)), up, input_precision="ieee")
            else:
                gate = tl.dot(xk, tl.trans(tl.load(w_gate + k0)), gate)
                up = tl.dot(xk, tl.trans(tl.load(w_up + k0)), up)
        h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
        tl.store(h_ptr + rows[:, None].to(tl.int64) * INNER + cols[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=live[:, None])


@triton.jit
def _down_kernel(h_ptr, ends_ptr, w_ptr, y_ptr, HIDDEN, INNER,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    e = tl.program_id(0)
    end = tl.load(ends_ptr + e)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w = w_ptr + e.to(tl.int64) * (HIDDEN * INNER) + cols[:, None] * INNER + ks[None, :]
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        live = rows < end
        hs = h_ptr + rows[:, None].to(tl.int64) * INNER + ks[None, :]
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, INNER, BLOCK_K):
            hk = tl.load(hs + k0, mask=live[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(hk, tl.trans(tl.load(w + k0)), acc, input_precision="ieee")
            else:
                acc = tl.dot(hk, tl.trans(tl.load(w + k0)), acc)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * HIDDEN + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=live[:, None])


def _blocks(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for an output of ``n`` columns over ``k``: the defaults, or the largest
    powers of two that divide smaller sizes."""
    return min(BLOCK_N, n & -n), min(BLOCK_K, k & -k)


def fits(x: torch.Tensor, pairs: int, gate_up: torch.Tensor) -> bool:
    """These kernels take this call: CUDA (or a CPU under Triton's interpreter), a decode-sized
    batch, and sizes whose tiles hold at least 16 columns (the tensor cores' least)."""
    inner, hidden = gate_up.shape[1] // 2, gate_up.shape[2]
    device_ok = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (device_ok and pairs <= MAX_PAIRS and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and min(_blocks(inner, hidden)) >= 16 and min(_blocks(hidden, inner)) >= 16)


@torch.library.custom_op("mstar::moe_gate_up", mutates_args=())
def moe_gate_up(x: torch.Tensor, token: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """h [P, I] = silu(gate) * up of each sorted pair's row (``token``) through its expert."""
    e, two_i, hidden = gate_up.shape
    inner = two_i // 2
    h = x.new_empty(token.shape[0], inner)
    bn, bk = _blocks(inner, hidden)
    _gate_up_kernel[(e, inner // bn)](x.contiguous(), token.contiguous(), ends, gate_up.contiguous(), h, hidden,
                                      inner, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, IEEE=x.dtype == torch.float32,
                                      num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return h


@moe_gate_up.register_fake
def _(x, token, ends, gate_up):
    return x.new_empty(token.shape[0], gate_up.shape[1] // 2)


@torch.library.custom_op("mstar::moe_down", mutates_args=())
def moe_down(h: torch.Tensor, ends: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """y [P, H]: each sorted pair's h through its expert's down projection."""
    e, hidden, inner = down.shape
    y = h.new_empty(h.shape[0], hidden)
    bn, bk = _blocks(hidden, inner)
    _down_kernel[(e, hidden // bn)](h.contiguous(), ends, down.contiguous(), y, hidden, inner, BLOCK_M=BLOCK_M,
                                    BLOCK_N=bn, BLOCK_K=bk, IEEE=h.dtype == torch.float32, num_warps=NUM_WARPS,
                                    num_stages=NUM_STAGES)
    return y


@moe_down.register_fake
def _(h, ends, down):
    return h.new_empty(h.shape[0], down.shape[1])
