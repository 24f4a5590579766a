"""Plot decode_step.py runs side by side: each (part, batch)'s CUDA-graph pass with compiled layers
(``compiled_graph_ms``, or ``graph_ms`` where the run had no --compiled), one bar per run; runs of
one call compare (a baseline and the change), runs of different calls do not.

    python bench/qwen3_omni/plot_decode.py old.json:48efe53 new.json:now --out decode.png
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="FILE:LABEL")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="Qwen3-Omni decode pass (CUDA graph)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for spec in args.runs:
        path, _, label = spec.rpartition(":")
        rows = json.load(open(path))["rows"]
        runs.append((label, {(r["part"], r["batch"]): r.get("compiled_graph_ms", r["graph_ms"]) for r in rows}))
    keys = sorted({k for _, ms in runs for k in ms}, key=lambda k: (k[0] != "thinker", k[0], k[1]))
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(1.6 * len(keys) + 2, 4))
    for i, (label, ms) in enumerate(runs):
        xs = [j + i * width for j, k in enumerate(keys) if k in ms]
        ys = [ms[k] for k in keys if k in ms]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"{p}\n{b} row{'s' if b > 1 else ''}" for p, b in keys])
    ax.set_ylabel("ms a pass")
    ax.set_title(args.title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
