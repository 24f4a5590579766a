"""Plot a bench_omni.py run: audio seconds per second and time to first audio against concurrency,
M* against the transformers baseline (JSON files from one call: --parts mstar / baseline, or both).

    python bench/qwen3_omni/plot_omni.py bench/results/qwen3_omni/2026-11-26-h200x4/omni_*.json --out plot.png
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = {"mstar": [], "baseline": []}
    for path in args.runs:
        run = json.load(open(path))
        for key in rows:
            rows[key] += run.get(key, [])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("mstar", "M* (served, streaming)"), ("baseline", "transformers generate")):
        r = sorted(rows[key], key=lambda x: x["streams"])
        n = [x["streams"] for x in r]
        a.plot(n, [x["audio_s_per_s"] for x in r], "o-", label=label)
        b.plot(n, [x["ttfa_p50_s"] for x in r], "o-", label=label)
    top = max(x["streams"] for x in rows["mstar"] + rows["baseline"])
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
