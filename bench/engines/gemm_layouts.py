"""cuBLAS on the decode step's four projections under each activation layout: does handing cuBLAS
the input and/or the output transposed (same math) make it pick a kernel that streams the weight
faster at decode batch sizes? Weights column-major as the engine stores them ([N, K] with strides
(1, N)), 28 distinct copies per graph (so L2 holds none across calls), CUDA-event medians, µs per
GEMM. Also the residual-add form the fused-norm path uses (``h.addmm_(x, W.t())``, beta = 1).

    python bench/engines/gemm_layouts.py --out gemm_layouts.json [--ms 1,16,64]
"""

from __future__ import annotations

import argparse
import time

import torch
from gpu_timing import graph_replay_ms, record_row

LAYERS = 28
SHAPES = {"qkv": (5120, 3072), "o_proj": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)}


def us(fn) -> float:
    return graph_replay_ms(fn, reps=30) * 1e3 / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16,64")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    r = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "rows": []}
    t0 = time.time()
    for name, (n, k) in SHAPES.items():
        wt = [torch.randn(k, n, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]  # W.t() contiguous
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            x_cm = x.t().contiguous().t()  # [m, k], column-major
            h = torch.randn(m, n, device=dev, dtype=dt)
            h_cm = h.t().contiguous().t()
            row = {"gemm": name, "m": m, "weight_MB": n * k * 2 / 1e6}
            # out row-major (what the engine does): x @ W.t()
            row["x_row_out_row_us"] = us(lambda: [torch.mm(x, w) for w in wt])  # noqa: B023
            row["x_col_out_row_us"] = us(lambda: [torch.mm(x_cm, w) for w in wt])  # noqa: B023
            # out column-major: (W @ x.t()).t()
            row["x_row_out_col_us"] = us(lambda: [torch.mm(w.t(), x.t()) for w in wt])  # noqa: B023
            row["x_col_out_col_us"] = us(lambda: [torch.mm(w.t(), x_cm.t()) for w in wt])  # noqa: B023
            row["addmm_row_us"] = us(lambda: [h.addmm_(x, w) for w in wt])  # noqa: B023
            row["addmm_col_us"] = us(lambda: [h_cm.t().addmm_(w.t(), x_cm.t()) for w in wt])  # noqa: B023
            want = (x.float() @ wt[0].float())
            for lbl, got in (("x_col_out_col", torch.mm(wt[0].t(), x_cm.t()).t()), ("x_row_out_col", torch.mm(wt[0].t(), x.t()).t())):
                row[f"{lbl}_rel_err"] = ((got.float() - want).norm() / want.norm()).item()
            best = min((v, kk) for kk, v in row.items() if kk.endswith("_us") and not kk.startswith("addmm"))
            row["best"], row["floor_us"] = best[1], n * k * 2 / 2.93e12 * 1e6
            record_row(r, row, args.out, t0)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
