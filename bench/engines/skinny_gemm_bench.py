"""Decode-size projections of the Llama-3.2-3B shape: the Triton skinny GEMM
(``gemm_triton.py``) under launch configurations vs cuBLAS through F.linear (weights
column-major as the engine stores them, and row-major). 28 weight copies per shape, one per
layer, in one CUDA graph (so L2 does not hold a weight across calls); µs per GEMM, medians.

    python bench/engines/skinny_gemm_bench.py --out skinny_gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import torch.nn.functional as F

from mstar.services.engines.gemm_triton import skinny_linear

SHAPES = {"qkv": (5120, 3072), "o_proj": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)}
LAYERS = 28


def graph_us(fn, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times) * 1e3 / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--block-k", default="256,512")
    ap.add_argument("--split-k", default="1,2,4")
    ap.add_argument("--stages", default="4")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    r = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "rows": []}
    t0 = time.time()
    configs = list(itertools.product(*(map(int, getattr(args, a).split(",")) for a in
                                       ("block_n", "block_k", "split_k", "stages"))))
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
        wcm = [w.t().contiguous().t() for w in ws]  # column-major, as set_weight_layout stores them on CUDA
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = F.linear(x, ws[0]).float()
            row = {"gemm": name, "m": m, "weight_MB": n * k * 2 / 1e6,
                   "cublas_colmajor_us": graph_us(lambda: [F.linear(x, w) for w in wcm]),  # noqa: B023
                   "cublas_rowmajor_us": graph_us(lambda: [F.linear(x, w) for w in ws])}  # noqa: B023
            best = None
            for bn, bk, sk, st in configs:
                key = f"{bn}x{bk}x{sk}x{st}"
                try:
                    out = skinny_linear(x, ws[0], bn, bk, sk, num_stages=st).float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    us = graph_us(lambda: [skinny_linear(x, w, bn, bk, sk, num_stages=st) for w in ws])  # noqa: B023
                except Exception as e:  # a configuration that does not compile
                    row[f"triton_{key}_error"] = repr(e)[:200]
                    continue
                row[f"triton_{key}_us"] = us
                if err > 1e-2:
                    row[f"triton_{key}_rel_err"] = err
                elif best is None or us < best[0]:
                    best = (us, key)
            if best:
                row["best_triton"], row["best_triton_us"] = best[1], best[0]
                row["cublas_colmajor_over_best_triton"] = row["cublas_colmajor_us"] / best[0]
                row["best_triton_GBps"] = n * k * 2 / (best[0] * 1e-6) / 1e9
            row["cublas_colmajor_GBps"] = n * k * 2 / (row["cublas_colmajor_us"] * 1e-6) / 1e9
            print(json.dumps({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items()
                              if not a.startswith("triton_")}), flush=True)
            r["rows"].append(row)
            r["elapsed_s"] = time.time() - t0
            with open(args.out, "w") as f:
                json.dump(r, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
