"""The MLP's tail at decode sizes (Llama-3.2-3B shape: gate_up output [M, 2 x 8192] -> [M, 3072]):
SiLU·mul + cuBLAS down projection on column-major weights (what the engine runs without the
fused kernel; FlashInfer's SiLU·mul when it imports) vs the fused Triton kernel
(services/engines/mlp_triton.py) on row-major weights under launch configurations. 28 weight copies (one per layer) in one CUDA graph, so L2 does not hold a
weight across calls; µs per layer, medians of graph replays timed with CUDA events.

    python bench/engines/mlp_down_bench.py --out mlp_down.json [--ms 1,8,16,32,64]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
from gpu_timing import graph_replay_ms

from mstar.services.engines.mlp_triton import CONFIGS, SiluMulDown, padded_rows

LAYERS, N, INTER = 28, 3072, 8192


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,8,16,32,64")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--block-k", default="256,512")
    ap.add_argument("--split-k", default="1,2")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="3,4,5")
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
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "silu_mul": silu_name,
           "default_configs": {str(k): v for k, v in CONFIGS.items()}, "args": vars(args), "rows": []}
    t0 = time.time()
    grid = list(itertools.product(*(map(int, getattr(args, a).split(",")) for a in
                                    ("block_n", "block_k", "split_k", "warps", "stages"))))
    for m in map(int, args.ms.split(",")):
        x = torch.randn(m, 2 * INTER, device=dev, dtype=dt)
        want = F.linear(silu_mul(x), ws[0]).float()
        row = {"m": m, "weight_MB": N * INTER * 2 / 1e6,
               "unfused_us": graph_replay_ms(lambda: [F.linear(silu_mul(x), w) for w in wcm]) * 1e3 / LAYERS,  # noqa: B023
               "unfused_row_major_us": graph_replay_ms(lambda: [F.linear(silu_mul(x), w) for w in ws]) * 1e3 / LAYERS,  # noqa: B023
               "gemm_alone_us": graph_replay_ms(lambda: [F.linear(x[:, :INTER], w) for w in wcm]) * 1e3 / LAYERS}  # noqa: B023
        fused = SiluMulDown()
        row["fused_default_us"] = graph_replay_ms(lambda: [fused(x, w, None) for w in ws]) * 1e3 / LAYERS  # noqa: B023
        row["fused_default_rel_err"] = ((fused(x, ws[0], None).float() - want).norm() / want.norm()).item()
        best = None
        for cfg in grid:
            key = "x".join(map(str, cfg))
            k = SiluMulDown({padded_rows(m): cfg})
            try:
                err = ((k(x, ws[0], None).float() - want).norm() / want.norm()).item()
                us = graph_replay_ms(lambda: [k(x, w, None) for w in ws]) * 1e3 / LAYERS  # noqa: B023
            except Exception as e:  # a configuration that does not compile or fit
                row[f"fused_{key}_error"] = repr(e)[:160]
                continue
            row[f"fused_{key}_us"] = us
            if err > 1e-2:
                row[f"fused_{key}_rel_err"] = err
            elif best is None or us < best[0]:
                best = (us, key)
        if best:
            row["best"], row["best_us"] = best[1], best[0]
            row["unfused_over_best"] = row["unfused_us"] / best[0]
            row["best_GBps"] = N * INTER * 2 / (best[0] * 1e-6) / 1e9
        row["unfused_over_default"] = row["unfused_us"] / row["fused_default_us"]
        print(json.dumps({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items()
                          if not a.startswith("fused_") or "default" in a}), flush=True)
        res["rows"].append(row)
        res["elapsed_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
