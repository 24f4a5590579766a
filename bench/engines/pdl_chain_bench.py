"""Can programmatic dependent launch hide the decode GEMMs' fixed cost? At 16 rows each
Llama-3.2-3B projection streams its weight at about the HBM rate plus a fixed ~3.5 µs of launch,
ramp and tail (bench/results/engines/2026-11-25e/packed_gemm.json: the packed kernel's time vs
bytes). Those fixed costs add up along a layer's chain of GEMMs, none of which can start before
the one before it has written its output.

But a GEMM's weight does not depend on its input. Here each GEMM is a Triton kernel over the
packed weight layout (packed_gemm_bench.py) launched as a programmatic dependent launch: it
may start while the kernel before it is still running, asks L2 for the first PREFETCH tiles of
its weight, and only then waits (``gdc_wait``) for its input. The kernel before it allows the
early start with ``gdc_launch_dependents`` at its start (TRIGGER 1) or after its K loop
(TRIGGER 2).

The chain: 28 layers of qkv -> o_proj -> gate_up -> down at 16 rows, each GEMM reading the
previous one's output (its first K columns), in one CUDA graph; µs per layer, median of graph
replays. Variants: cuBLAS (F.linear, column-major weights as the engine stores them), the
packed kernel without PDL, and with PDL for each TRIGGER x PREFETCH. A PDL variant's output must
equal the packed kernel's bit for bit (same arithmetic; a race would change it).

    python bench/engines/pdl_chain_bench.py --out pdl_chain.json [--rows 16] [--prefetch 0,2,4,8]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
from gpu_timing import graph_replay_ms
from packed_gemm_bench import gdc_wait, pack, packed_kernel
from skinny_gemm_bench import LAYERS, SHAPES

#: (BLOCK_N, BLOCK_K, stages) per projection: the packed kernel's best at 16 rows (packed_gemm.json)
CONFIGS = {"qkv": (64, 256, 4), "o_proj": (32, 256, 4), "gate_up": (64, 128, 3), "down": (32, 256, 4)}
ORDER = ("qkv", "o_proj", "gate_up", "down")


def chain_triton(x0, layers, outs, pdl: bool, trigger: int, prefetch: int) -> torch.Tensor:
    x = x0
    for wps in layers:
        for name, wp, y in zip(ORDER, wps, outs, strict=True):
            nb, kb, bn, bk = wp.shape
            _, _, stages = CONFIGS[name]
            packed_kernel[(nb,)](x, wp, y, x.shape[0], nb * bn, kb * bk, x.stride(0), y.stride(0),
                                 BM=max(16, triton.next_power_of_2(x.shape[0])), BLOCK_N=bn, BLOCK_K=bk,
                                 PDL=pdl, TRIGGER=trigger, PREFETCH=prefetch, num_warps=4, num_stages=stages,
                                 launch_pdl=pdl)
            x = y[:, : SHAPES[ORDER[(ORDER.index(name) + 1) % 4]][1]]  # the next GEMM's K columns
    return outs[-1]


def chain_cublas(x0, layers, outs) -> torch.Tensor:
    x = x0
    for ws in layers:
        for name, w, y in zip(ORDER, ws, outs, strict=True):
            torch.matmul(x, w.t(), out=y)
            x = y[:, : SHAPES[ORDER[(ORDER.index(name) + 1) % 4]][1]]
    return outs[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--triggers", default="1,2")
    ap.add_argument("--prefetch", default="0,2,4,8")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    ws = [[torch.randn(*SHAPES[n], device=dev, dtype=dt) / SHAPES[n][1] ** 0.5 for n in ORDER] for _ in range(LAYERS)]
    wcm = [[w.t().contiguous().t() for w in layer] for layer in ws]  # column-major, as the engine stores them
    packed = [[pack(w, *CONFIGS[n][:2]) for n, w in zip(ORDER, layer, strict=True)] for layer in ws]
    del ws
    x0 = torch.randn(args.rows, SHAPES["qkv"][1], device=dev, dtype=dt)
    outs = [torch.empty(args.rows, SHAPES[n][0], device=dev, dtype=dt) for n in ORDER]
    weight_bytes = sum(SHAPES[n][0] * SHAPES[n][1] * 2 for n in ORDER)
    r = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "args": vars(args), "configs": CONFIGS, "layers": LAYERS, "weight_MB_per_layer": weight_bytes / 1e6,
         "us_per_layer": {}}
    t0 = time.time()

    def timed(key, fn):
        us = graph_replay_ms(fn, reps=args.reps) * 1e3 / LAYERS
        r["us_per_layer"][key] = us
        print(f"{key}: {us:.2f} µs a layer ({weight_bytes / us / 1e3:.0f} GB/s)", flush=True)
        return us

    timed("cublas", lambda: chain_cublas(x0, wcm, outs))
    want = chain_cublas(x0, wcm, outs).float().clone()
    timed("packed", lambda: chain_triton(x0, packed, outs, False, 0, 0))
    ref = chain_triton(x0, packed, outs, False, 0, 0).clone()
    r["packed_vs_cublas_rel_err"] = ((ref.float() - want).norm() / want.norm()).item()
    r["pdl"] = []
    if gdc_wait is None:
        r["pdl_error"] = "this Triton has no gdc_wait"
    for trig in map(int, args.triggers.split(",")):
        for pf in map(int, args.prefetch.split(",")):
            key = f"pdl_trigger{trig}_prefetch{pf}"
            try:
                outs[-1].zero_()
                us = timed(key, lambda t=trig, p=pf: chain_triton(x0, packed, outs, True, t, p))
                torch.cuda.synchronize()
                replayed = outs[-1].clone()  # what the graph's last replay wrote
                eager = chain_triton(x0, packed, outs, True, trig, pf).clone()
                r["pdl"].append({"trigger": trig, "prefetch_tiles": pf, "us_per_layer": us,
                                 "graph_bitwise_equal_to_packed": bool(torch.equal(replayed, ref)),
                                 "eager_bitwise_equal_to_packed": bool(torch.equal(eager, ref))})
            except Exception as e:
                r["pdl"].append({"trigger": trig, "prefetch_tiles": pf, "error": repr(e)[:300]})
                print(key, "failed:", repr(e)[:300], flush=True)
    r["elapsed_s"] = time.time() - t0
    import json

    with open(args.out, "w") as f:
        json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
