"""The MLP's tail at decode sizes (Llama-3.2-3B shape: gate_up output [M, 2 x 8192] -> [M, 3072]):
SiLU·mul + cuBLAS down projection on column-major weights (what the engine runs; FlashInfer's
SiLU·mul when it imports) vs a fused Triton kernel (below: SiLU·mul as the GEMM's prologue,
split-K reduced in the same launch by the last slice to finish) on row-major weights, under
launch configurations. 28 weight copies (one per layer) in one CUDA graph, so L2 does not hold
a weight across calls; µs per layer, medians of graph replays timed with CUDA events.

Column-major tiles, the first version (a), with ``--fused-layout column``; the engine version's
bias is gone (4f7ee30 has it). A measurement only: the fused kernel lost to cuBLAS + SiLU·mul at 16 and 64 rows and tied at
one (bench/results/engines/mlp-down/), so the engine keeps the unfused tail.

    python bench/engines/mlp_down_bench.py --out mlp_down.json [--ms 1,8,16,32,64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gpu_timing import add_grid_args, config_grid, graph_replay_ms, record_row, sweep

#: the kernel's launch configuration per padded row count: (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)
CONFIGS: dict[int, tuple[int, int, int, int, int]] = {
    16: (64, 256, 2, 4, 3),
    32: (32, 256, 2, 4, 3),
    64: (64, 128, 2, 4, 3),
}


@triton.jit
def _silu_mul_down_kernel(
    gu_ptr, gu_stride,  # gate_up output [M, 2I], rows strided, columns dense
    w_ptr, w_stride_n, w_stride_k,  # down weight, logical [N, I]
    out_ptr, out_stride,  # out [M, N]
    part_ptr, count_ptr,  # split-K: fp32 [SPLIT_K, BM, N] partial sums, int32 [cdiv(N, BLOCK_N)] finished slices
    # M rows, N outputs, K intermediate features (gate_up holds 2K columns)
    M, N, K,
    BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    W_ROW_MAJOR: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = w_ptr.dtype.element_ty
    rm = tl.arange(0, BM)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # slices start on BLOCK_K boundaries
    k0 = pid_k * k_per
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    # gate / up feed the dot through SiLU·mul, so Triton does not pipeline their loads as it
    # does the weight's: each iteration loads the next one's by hand, off the critical path
    arow = gu_ptr + rm[:, None] * gu_stride + rk[None, :]
    amask = mmask[:, None] & (k0 + rk < K)[None, :]
    g_next = tl.load(arow + k0, mask=amask, other=0.0)
    u_next = tl.load(arow + k0 + K, mask=amask, other=0.0)
    for k in range(k0, tl.minimum(k0 + k_per, K), BLOCK_K):
        kk = k + rk
        kmask = kk < K  # against K itself, whose divisibility Triton knows: the loads stay vectorised
        g = g_next.to(tl.float32)
        u = u_next.to(tl.float32)
        amask = mmask[:, None] & (kk + BLOCK_K < K)[None, :]
        g_next = tl.load(arow + k + BLOCK_K, mask=amask, other=0.0)
        u_next = tl.load(arow + k + BLOCK_K + K, mask=amask, other=0.0)
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
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch


def padded_rows(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


class SiluMulDown:
    """The fused kernel with its split-K workspace and counters (launches on one stream run one
    after another, so all share them). Buffers are allocated on the first call for a row
    count: call once before capturing a CUDA graph."""

    def __init__(self, configs: dict[int, tuple[int, int, int, int, int]] | None = None):
        self.configs = dict(CONFIGS if configs is None else configs)
        # (padded rows, N) -> (workspace, counters); never freed or grown, because captured
        # graphs keep their addresses
        self._split: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """gate_up [M, 2I] (columns dense), weight [N, I] (row- or column-major) ->
        silu(gate_up[:, :I]) * gate_up[:, I:] @ weight.T, [M, N] in gate_up's dtype."""
        m, two_i = gate_up.shape
        n, i = weight.shape
        if two_i != 2 * i or gate_up.stride(1) != 1:
            raise ValueError(f"gate_up must be [M, {2 * i}] with dense columns for a [{n}, {i}] down weight, "
                             f"got {tuple(gate_up.shape)} strides {gate_up.stride()}")
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
            out, out.stride(0), part, count, m, n, i,
            BM=bm, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
            W_ROW_MAJOR=weight.stride(1) == 1,
            num_warps=warps, num_stages=stages,
        )
        return out


LAYERS, N, INTER = 28, 3072, 8192


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,8,16,32,64")
    add_grid_args(ap, block_n="16,32,64", block_k="256,512", split_k="1,2", warps="4", stages="3,4,5")
    ap.add_argument("--fused-layout", choices=("row", "column"), default="row",
                    help="the down weights the fused kernel reads (column: version (a) of the README)")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    try:
        import flashinfer

        silu_mul, silu_name = flashinfer.silu_and_mul, "flashinfer"
    except ImportError:
        def silu_mul(x):
            return F.silu(x[:, :INTER]) * x[:, INTER:]
        silu_name = "torch"
    ws = [torch.randn(N, INTER, device=dev, dtype=dt) / INTER**0.5 for _ in range(LAYERS)]  # row-major: the fused kernel's
    wcm = [w.t().contiguous().t() for w in ws]  # column-major: the engine's layout for cuBLAS without the fused kernel
    wf = ws if args.fused_layout == "row" else wcm
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "silu_mul": silu_name,
           "default_configs": {str(k): v for k, v in CONFIGS.items()}, "args": vars(args), "rows": []}
    t0 = time.time()
    grid = config_grid(args, ("block_n", "block_k", "split_k", "warps", "stages"))
    for m in map(int, args.ms.split(",")):
        x = torch.randn(m, 2 * INTER, device=dev, dtype=dt)
        want = F.linear(silu_mul(x), ws[0]).float()
        row = {"m": m, "weight_MB": N * INTER * 2 / 1e6,
               "unfused_us": graph_replay_ms(lambda: [F.linear(silu_mul(x), w) for w in wcm]) * 1e3 / LAYERS,  # noqa: B023
               "unfused_row_major_us": graph_replay_ms(lambda: [F.linear(silu_mul(x), w) for w in ws]) * 1e3 / LAYERS,  # noqa: B023
               "gemm_alone_us": graph_replay_ms(lambda: [F.linear(x[:, :INTER], w) for w in wcm]) * 1e3 / LAYERS}  # noqa: B023
        fused = SiluMulDown()
        try:
            row["fused_default_us"] = graph_replay_ms(lambda: [fused(x, w) for w in wf]) * 1e3 / LAYERS  # noqa: B023
            row["fused_default_rel_err"] = ((fused(x, wf[0]).float() - want).norm() / want.norm()).item()
        except Exception as e:  # recorded; the sweep below still runs
            row["fused_default_error"] = repr(e)[:160]
        def run(cfg, x=x, m=m):
            k = SiluMulDown({padded_rows(m): cfg})
            return k(x, wf[0]), graph_replay_ms(lambda: [k(x, w) for w in wf]) * 1e3 / LAYERS

        best = sweep(row, "fused_", grid, run, want)
        if best:
            row["best"], row["best_us"] = best[1], best[0]
            row["unfused_over_best"] = row["unfused_us"] / best[0]
            row["best_GBps"] = N * INTER * 2 / (best[0] * 1e-6) / 1e9
        if "fused_default_us" in row:
            row["unfused_over_default"] = row["unfused_us"] / row["fused_default_us"]
        record_row(res, row, args.out, t0, show=lambda key: not key.startswith("fused_") or "default" in key)


if __name__ == "__main__":
    main()
