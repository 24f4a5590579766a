"""Does the weight's memory layout limit the decode-size projections? The Llama-3.2-3B projections
at a few rows read their weight once, so their time is the weight's bytes over the bandwidth the
kernel reaches. cuBLAS reaches 68-95% of the copy bandwidth at 16 rows (o_proj lowest,
bench/results/engines/skinny-gemm/); the row-major Triton kernel (skinny_gemm_bench.py) no more.
Each program of those kernels reads BLOCK_N rows of W in BLOCK_K-wide runs: BLOCK_N separate
512-byte pieces per pipeline stage, scattered over BLOCK_N DRAM rows.

Two layouts of the same math, y = x @ W.T, x [M, K], W [N, K]:
- ``packed``: W stored as tiles [N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K], each program's
  tiles back to back, so every pipeline stage loads one contiguous BLOCK_N x BLOCK_K block and a
  program streams one contiguous range of memory;
- ``tma``: the row-major W through a Hopper TMA descriptor (the copy engine fetches each
  [BLOCK_N, BLOCK_K] box; BLOCK_K <= 256).

Against cuBLAS (F.linear, W column-major as the engine stores it) and the row-major Triton
kernel, 28 weight copies in one CUDA graph (L2 holds none across calls); µs per GEMM, medians.

    python bench/engines/packed_gemm_bench.py --out packed_gemm.json [--ms 1,16] [--shapes o_proj,qkv]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gpu_timing import add_grid_args, config_grid, record_row, sweep
from skinny_gemm_bench import LAYERS, SHAPES, graph_us, skinny_linear

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: pdl_chain_bench.py records why
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _prefetch_l2(ptr, LINES: tl.constexpr):
    at = ptr.to(tl.pointer_type(tl.int8)) + tl.arange(0, LINES).to(tl.int64) * 128
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [at],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def packed_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                   BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr = False, TRIGGER: tl.constexpr = 0, PREFETCH: tl.constexpr = 0):
    """PDL (pdl_chain_bench.py): launched as a programmatic dependent launch, ask L2 for the first
    PREFETCH weight tiles, then wait for the input; let the next kernel start at this one's start
    (TRIGGER 1) or after its K loop (TRIGGER 2)."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BLOCK_K)
    tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + rk[None, :]
    k_tiles = K // BLOCK_K
    base = w_ptr + pid.to(tl.int64) * k_tiles * (BLOCK_N * BLOCK_K)
    if PDL:
        if TRIGGER == 1:
            gdc_launch_dependents()
        if PREFETCH > 0:
            _prefetch_l2(base, PREFETCH * BLOCK_N * BLOCK_K * 2 // 128)
        gdc_wait()  # the input (the previous kernel's output) is complete from here
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for i in range(0, k_tiles):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (i * BLOCK_K + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(base + i * (BLOCK_N * BLOCK_K) + tile)
        if x.dtype == tl.float32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if PDL:
        if TRIGGER == 2:
            gdc_launch_dependents()
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


def pack(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """W [N, K] -> its tiles [N / block_n, K / block_k, block_n, block_k], contiguous."""
    n, k = w.shape
    if n % block_n or k % block_k:
        raise ValueError(f"W {tuple(w.shape)} does not split into {block_n} x {block_k} tiles")
    return w.reshape(n // block_n, block_n, k // block_k, block_k).permute(0, 2, 1, 3).contiguous()


def packed_linear(x: torch.Tensor, wp: torch.Tensor, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [M, K] @ W.T with W given as ``pack(W, block_n, block_k)``."""
    nb, kb, block_n, block_k = wp.shape
    m, k = x.shape
    if kb * block_k != k or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} does not match the packed weight {tuple(wp.shape)}")
    y = torch.empty((m, nb * block_n), device=x.device, dtype=x.dtype)
    packed_kernel[(nb,)](x, wp, y, m, nb * block_n, k, x.stride(0), y.stride(0),
                          BM=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
                          num_warps=num_warps, num_stages=num_stages)
    return y


@triton.jit
def _tma_kernel(x_ptr, w_desc, y_ptr, M, N, K, stride_xm, stride_ym,
                BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        w = w_desc.load([pid * BLOCK_N, k])
        acc += tl.dot(x, tl.trans(w))
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


def tma_descriptor(w: torch.Tensor, block_n: int, block_k: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w, [block_n, block_k])


def tma_linear(x: torch.Tensor, desc, n: int, block_n: int, block_k: int, num_warps: int = 4,
               num_stages: int = 4) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    _tma_kernel[(triton.cdiv(n, block_n),)](x, desc, y, m, n, k, x.stride(0), y.stride(0),
                                            BM=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n,
                                            BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="16,1")
    ap.add_argument("--shapes", default="o_proj,qkv,down,gate_up")
    ap.add_argument("--layouts", default="rowmajor,packed,tma")
    ap.add_argument("--deadline", type=float, default=0.0, help="unix time: skip what is left after it")
    add_grid_args(ap, block_n="16,32,64", block_k="128,256", stages="3,4,6", warps="4")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    r = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "args": vars(args), "rows": []}
    t0 = time.time()
    configs = config_grid(args, ("block_n", "block_k", "stages", "warps"))
    layouts = args.layouts.split(",")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
        wcm = [w.t().contiguous().t() for w in ws]  # column-major, as set_weight_layout stores them on CUDA
        for m in map(int, args.ms.split(",")):
            if args.deadline and time.time() > args.deadline:
                r["skipped"] = r.get("skipped", []) + [f"{name} m={m}"]
                continue
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = F.linear(x, ws[0]).float()
            row = {"gemm": name, "m": m, "weight_MB": n * k * 2 / 1e6,
                   "cublas_colmajor_us": graph_us(lambda: [F.linear(x, w) for w in wcm])}  # noqa: B023
            for layout in layouts:
                def run(cfg, x=x, ws=ws, layout=layout, n=n):
                    bn, bk, st, nw = cfg
                    if layout == "rowmajor":
                        return (skinny_linear(x, ws[0], bn, bk, 1, nw, st),
                                graph_us(lambda: [skinny_linear(x, w, bn, bk, 1, nw, st) for w in ws]))
                    if layout == "packed":
                        wps = [pack(w, bn, bk) for w in ws]
                        return (packed_linear(x, wps[0], nw, st),
                                graph_us(lambda: [packed_linear(x, wp, nw, st) for wp in wps]))
                    descs = [tma_descriptor(w, bn, bk) for w in ws]
                    return (tma_linear(x, descs[0], n, bn, bk, nw, st),
                            graph_us(lambda: [tma_linear(x, d, n, bn, bk, nw, st) for d in descs]))

                best = sweep(row, f"{layout}_", configs, run, ref)
                if best:
                    row[f"best_{layout}"], row[f"best_{layout}_us"] = best[1], best[0]
                    row[f"best_{layout}_GBps"] = n * k * 2 / (best[0] * 1e-6) / 1e9
                torch.cuda.empty_cache()
            row["cublas_colmajor_GBps"] = n * k * 2 / (row["cublas_colmajor_us"] * 1e-6) / 1e9
            record_row(r, row, args.out, t0, show=lambda key: key.startswith(("gemm", "m", "cublas", "best")))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
