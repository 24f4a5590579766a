"""Plot a bench_omni.py run: audio seconds per second and time to first audio against concurrency,
M* against the transformers baseline (JSON files from one call: --parts mstar / baseline, or both).

    python bench/qwen3_omni/plot_omni.py bench/results/qwen3_omni/2026-11-27b-h200/6-full/omni.json --out plot.png

``--labels`` (one per run): each run's M* rows are a curve of their own under that label (runs of
one call with different settings, e.g. CUDA graphs on and off); the baseline rows stay one curve.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--labels", nargs="+", help="a label per run for its M* rows")
    args = ap.parse_args()
    if args.labels and len(args.labels) != len(args.runs):
        ap.error(f"{len(args.labels)} labels for {len(args.runs)} runs")
    curves: dict[str, list] = {}
    baseline: list = []
    for i, path in enumerate(args.runs):
        run = json.load(open(path))
        label = args.labels[i] if args.labels else "M* (served, streaming)"
        curves.setdefault(label, []).extend(run.get("mstar", []))
        baseline += run.get("baseline", [])
    curves = {k: v for k, v in curves.items() if v}
    if baseline:
        curves["transformers generate"] = baseline
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for label, rows in curves.items():
        r = sorted(rows, key=lambda x: x["streams"])
        n = [x["streams"] for x in r]
        a.plot(n, [x["audio_s_per_s"] for x in r], "o-", label=label)
        b.plot(n, [x["ttfa_p50_s"] for x in r], "o-", label=label)
    top = max(x["streams"] for rows in curves.values() for x in rows)
    a.plot([1, top], [1, top], "k:", label="every stream real time")
    a.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="audio seconds per second")
    b.axhline(0.25, color="k", ls=":", label="target 250 ms")
    b.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="time to first audio, p50 (s)")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Qwen3-Omni-30B-A3B shapes, random bf16 weights")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
