"""SwiGLU's tail at decode sizes as one Triton kernel: ``down(silu(gate) * up)``.

At a decode step the MLP's tail is otherwise three launches a layer: SiLU·mul, cuBLAS's
split-K GEMM and its split-K reduce. Each of the two small ones costs a few µs of launch and
ramp for a few KB of work (on an H100 at batch 16, 3.1 + 2.4 µs a layer next to the GEMM's 21),
so folding them into the GEMM saves them outright:

- each program owns ``BLOCK_N`` output columns and one of ``SPLIT_K`` slices of the
  intermediate dimension; it reads its gate and up columns of the gate_up GEMM's output
  (rows padded to 16 for ``tl.dot``), forms ``silu(gate) * up`` in fp32, rounds it to the
  weights' dtype (as the unfused SiLU·mul's output is) and multiplies it into an fp32
  accumulator while streaming its slice of the down weight;
- with several slices each writes its partial sums to a workspace and the last slice of an
  output tile to finish (an atomic counter, reset by that slice) adds them, the bias, and
  stores the tile: split-K without a second launch.

Weights are read through their strides. Row-major ([N, K], each output's weights contiguous)
is the fast layout here: a program then streams BLOCK_N long runs. Column-major tiles touch a
new DRAM row every BLOCK_N elements and ran 4-8x slower on an H100 without many K slices
(bench/results/engines/mlp-down/), so an engine that uses this kernel keeps its down weights
row-major (``layers.set_down_row_major``; cuBLAS reads them as fast at prefill). Used for at
most ``MAX_ROWS`` rows (decode batches); larger passes (prefill) stay with cuBLAS. On a
CPU it runs under ``TRITON_INTERPRET=1`` (fp32), which the tests use to check it against the
torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: rows (tokens) up to which the fused kernel runs; above, SiLU·mul + cuBLAS
MAX_ROWS = 64
#: launch configuration per padded row count: (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)
CONFIGS: dict[int, tuple[int, int, int, int, int]] = {
    16: (32, 512, 1, 4, 4),
    32: (32, 256, 1, 4, 4),
    64: (32, 256, 1, 4, 4),
}


@triton.jit
def _silu_mul_down_kernel(
    gu_ptr, gu_stride,  # gate_up output [M, 2I], rows strided, columns dense
    w_ptr, w_stride_n, w_stride_k,  # down weight, logical [N, I]
    bias_ptr, out_ptr, out_stride,  # bias [N] (HAS_BIAS), out [M, N]
    part_ptr, count_ptr,  # split-K: fp32 [SPLIT_K, BM, N] partial sums, int32 [cdiv(N, BLOCK_N)] finished slices
    # M rows, N outputs, K intermediate features (gate_up holds 2K columns)
    M, N, K,
    BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, W_ROW_MAJOR: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = w_ptr.dtype.element_ty
    rm = tl.arange(0, BM)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k0 = pid_k * k_per
    k1 = tl.minimum(k0 + k_per, K)
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k in range(k0, k1, BLOCK_K):
        kk = k + rk
        kmask = kk < k1
        amask = mmask[:, None] & kmask[None, :]
        arow = gu_ptr + rm[:, None] * gu_stride + kk[None, :]
        g = tl.load(arow, mask=amask, other=0.0).to(tl.float32)
        u = tl.load(arow + K, mask=amask, other=0.0).to(tl.float32)
        a = (g * tl.sigmoid(g) * u).to(dtype)
        if W_ROW_MAJOR:  # [BLOCK_N, BLOCK_K] tile: each output row's weights as one contiguous run
            w = tl.trans(tl.load(w_ptr + rn[:, None] * w_stride_n + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                                 other=0.0))
        else:
            w = tl.load(w_ptr + kk[:, None] * w_stride_k + rn[None, :] * w_stride_n,
                        mask=kmask[:, None] & nmask[None, :], other=0.0)
        if dtype == tl.float32:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    omask = mmask[:, None] & nmask[None, :]
    out = out_ptr + rm[:, None] * out_stride + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # Publish this slice's partial sums; the last slice of the tile to finish adds them all.
        tile = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + pid_k * BM * N + tile, acc, mask=nmask[None, :])
        tl.debug_barrier()  # every thread's stores precede the release below
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * BM * N + tile, mask=nmask[None, :], other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch


def padded_rows(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


class SiluMulDown:
    """The fused kernel with its split-K workspace and counters, one per engine (launches on
    one stream run one after another, so every layer and graph shares them). Buffers are
    allocated on the first call for a row count: call once per batch size before capturing
    a CUDA graph (the engine's warm-up runs do)."""

    def __init__(self, configs: dict[int, tuple[int, int, int, int, int]] | None = None):
        self.configs = dict(CONFIGS if configs is None else configs)
        # (padded rows, N) -> (workspace, counters); never freed or grown, because captured
        # graphs keep their addresses
        self._split: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def applies(self, rows: int) -> bool:
        return 0 < rows <= MAX_ROWS

    def __call__(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """gate_up [M, 2I] (columns dense), weight [N, I] (any strides), bias [N] or None ->
        silu(gate_up[:, :I]) * gate_up[:, I:] @ weight.T + bias, [M, N] in gate_up's dtype."""
        m, two_i = gate_up.shape
        n, i = weight.shape
        if two_i != 2 * i or gate_up.stride(1) != 1:
            raise ValueError(f"gate_up must be [M, {2 * i}] with dense columns for a [{n}, {i}] down weight, "
                             f"got {tuple(gate_up.shape)} strides {gate_up.stride()}")
        if not self.applies(m):
            raise ValueError(f"{m} rows: the fused SiLU·mul + down kernel takes 1..{MAX_ROWS}")
        bm = padded_rows(m)
        block_n, block_k, split_k, warps, stages = self.configs[bm]
        tiles = triton.cdiv(n, block_n)
        out = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
        if split_k > 1:
            bufs = self._split.get((bm, n))
            if bufs is None or bufs[0].numel() < split_k * bm * n or bufs[1].numel() < tiles:
                bufs = self._split[(bm, n)] = (torch.empty(split_k * bm * n, dtype=torch.float32, device=gate_up.device),
                                               torch.zeros(tiles, dtype=torch.int32, device=gate_up.device))
            part, count = bufs
        else:
            part = count = out
        _silu_mul_down_kernel[(tiles, split_k)](
            gate_up, gate_up.stride(0), weight, weight.stride(0), weight.stride(1),
            bias if bias is not None else out, out, out.stride(0), part, count, m, n, i,
            BM=bm, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, HAS_BIAS=bias is not None,
            W_ROW_MAJOR=weight.stride(1) == 1,
            num_warps=warps, num_stages=stages,
        )
        return out
