"""π0.5's engine records as a plot: per batch size, one action chunk split into vision / prefix / the
10-step loop (CUDA graph), for each record given, with the transformers baseline's end to end.

    python bench/pi05/plot_pi05.py OUT.png RECORD.json[:label] [RECORD.json[:label] ...] [served=SERVED.json[:label] ...]

``served=`` records (bench_served.py's JSON) add a panel: p50 latency at one client over gRPC and
through the gateway, and at each concurrency level, side by side per record.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2:]
    records, served = [], []
    for spec in specs:
        path, _, label = spec.removeprefix("served=").partition(":")
        if spec.startswith("served="):
            served.append((label or path, json.load(open(path))))
        else:
            records.append((label or path, {r["batch"]: r for r in json.load(open(path))["rows"]}))
    batches = sorted({b for _, rows in records for b in rows})
    panels = len(batches) + bool(served)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 4.2))
    axes = [axes] if panels == 1 else list(axes)
    if served:
        served_panel(axes.pop(), served)
    for ax, b in zip(axes, batches, strict=True):
        labels, x = [], 0
        for label, rows in records:
            r = rows.get(b)
            if r is None:
                continue
            bottom = 0.0
            for part, color in (("vision_ms", "#8fb8de"), ("prefix_ms", "#4a7fb0"), ("loop_graph_ms", "#e3914b")):
                ax.bar(x, r[part], bottom=bottom, color=color, label=part[:-3] if x == 0 else None)
                bottom += r[part]
            ax.text(x, bottom, f"{r['e2e_ms']:.1f}", ha="center", va="bottom", fontsize=8)
            labels.append(label)
            x += 1
            if "baseline_e2e_ms" in r:
                ax.bar(x, r["baseline_e2e_ms"], color="#bbbbbb", label="transformers baseline" if x == 1 else None)
                ax.text(x, r["baseline_e2e_ms"], f"{r['baseline_e2e_ms']:.1f}", ha="center", va="bottom", fontsize=8)
                labels.append(f"baseline\n({label})")
                x += 1
        if b == 1:
            ax.axhline(15, color="k", ls="--", lw=0.8, label="target 15 ms")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"batch {b}: ms per action chunk")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def served_panel(ax, served) -> None:
    levels = [k for k in served[0][1] if isinstance(served[0][1][k], dict) and "p50_ms" in served[0][1][k]
              and k != "profiled"]
    width = 0.8 / len(served)
    for i, (label, rec) in enumerate(served):
        xs = [j + i * width for j in range(len(levels))]
        ys = [rec.get(k, {}).get("p50_ms", 0.0) for k in levels]
        ax.bar(xs, ys, width, label=label)
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(20, color="k", ls="--", lw=0.8, label="target 20 ms (gRPC, 1 client)")
    ax.set_yscale("log")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(levels))], [k.replace("_", "\n") for k in levels], fontsize=7)
    ax.set_title("served: p50 ms per action chunk")
    ax.legend(fontsize=7, loc="upper left")


if __name__ == "__main__":
    main()
