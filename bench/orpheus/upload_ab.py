"""Summarize the decode-step upload A/B (bench/results/orpheus/2026-11-25d/): engine_steps.py
runs of several engine variants, alternated within each device call. Writes a table (stdout), a
summary JSON (per variant and batch: every run's step p50, their median, min, max) and a plot.

    python bench/orpheus/upload_ab.py bench/results/orpheus/2026-11-25d

Files are ``CALL/es-VARIANT-ORDER.json``; a run's ``step_ms_p50`` is the median decode step over
the steps where all rows decode (engine_steps.py).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def collect(root: Path) -> dict:
    runs: dict[str, dict[int, list[tuple[str, int, float]]]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(root.glob("call*/es-*.json")):
        variant, order = f.stem[3:].rsplit("-", 1)
        for r in json.loads(f.read_text())["runs"]:
            runs[variant][r["batch"]].append((f.parent.name, int(order), r["step_ms_p50"]))
    out = {}
    for variant, by_batch in runs.items():
        out[variant] = {}
        for batch, rs in sorted(by_batch.items()):
            vals = [v for _, _, v in rs]
            out[variant][batch] = {"runs": [{"call": c, "order": o, "step_ms_p50": v} for c, o, v in rs],
                                   "median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def main(root: str) -> None:
    root_p = Path(root)
    summary = collect(root_p)
    (root_p / "summary.json").write_text(json.dumps(summary, indent=2))
    batches = sorted({b for v in summary.values() for b in v})
    print("| variant | " + " | ".join(f"b{b} median (min–max), n" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for variant, by_batch in summary.items():
        cells = [f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f}), {len(s['runs'])}" if (s := by_batch.get(b)) else "–"
                 for b in batches]
        print(f"| {variant} | " + " | ".join(cells) + " |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches), figsize=(3.2 * len(batches), 3.6))
    for ax, b in zip(axes, batches, strict=True):
        names = [v for v in summary if b in summary[v]]
        for i, v in enumerate(names):
            ys = [r["step_ms_p50"] for r in summary[v][b]["runs"]]
            ax.plot([i] * len(ys), ys, "o", alpha=0.6)
            ax.plot([i - 0.25, i + 0.25], [summary[v][b]["median"]] * 2, "k-")
        ax.set_xticks(range(len(names)), names, rotation=45)
        ax.set_title(f"batch {b}")
        ax.set_ylabel("decode step p50, ms")
    fig.suptitle("Orpheus engine alone, H100: each dot one run, bar the median")
    fig.tight_layout()
    fig.savefig(root_p / "upload_ab.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1])
