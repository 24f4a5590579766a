"""V-JEPA 2's record as a plot: the encoder's time a clip per variant against transformers and the
FLOP floor (B = 1, 4), the CEM plan per variant against its floor and the 2x target, and the
rollout's speed-up over the recompute loop against its FLOP ratio.

    python bench/vjepa2/plot_vjepa2.py OUT.png RECORD_DIR      (vjepa2_{encoder,plan,rollout}.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    out, folder = sys.argv[1], Path(sys.argv[2])
    enc = json.loads((folder / "vjepa2_encoder.json").read_text())["encoder"]["batches"]
    plan = json.loads((folder / "vjepa2_plan.json").read_text())["plan"]
    roll = json.loads((folder / "vjepa2_rollout.json").read_text())["rollout"]["runs"]
    fig, axes = plt.subplots(1, len(enc) + 2, figsize=(4.0 * (len(enc) + 2), 4.2))
    for ax, r in zip(axes, enc, strict=False):
        names = ["transformers", *r["ours_s_by_variant"]]
        ms = [r["transformers_s"] * 1e3, *(v * 1e3 for v in r["ours_s_by_variant"].values())]
        per_clip = [m / r["batch"] for m in ms]
        ax.bar(range(len(names)), per_clip, color=["#999999"] + ["#4a7fb0"] * (len(names) - 1))
        floor = r["flop_floor_s"] * 1e3 / r["batch"]
        ax.axhline(floor, color="k", ls="--", lw=1, label=f"FLOP floor {floor:.1f} ms")
        ax.axhline(1.4 * floor, color="#c0392b", ls=":", lw=1, label="1.4x the floor (target)")
        for i, v in enumerate(per_clip):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_ylabel("ms a clip (64 frames, 256²)")
        ax.set_title(f"encoder ViT-L, B = {r['batch']}")
        ax.legend(fontsize=7)
    ax = axes[len(enc)]
    variants = plan["variants"]
    ax.bar(range(len(variants)), [v["seconds"] for v in variants.values()], color="#e3914b")
    ax.axhline(plan["floor_s"], color="k", ls="--", lw=1, label=f"FLOP floor {plan['floor_s']:.2f} s")
    ax.axhline(2 * plan["floor_s"], color="#c0392b", ls=":", lw=1, label="2x the floor (target)")
    for i, v in enumerate(variants.values()):
        ax.text(i, v["seconds"], f"{v['seconds']:.2f} s", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(variants)), list(variants), fontsize=8)
    ax.set_title("CEM plan at the defaults (400 x 2 steps x 10)")
    ax.legend(fontsize=7)
    ax = axes[-1]
    hs = [r["steps"] for r in roll]
    ax.plot(hs, [r["speedup"] for r in roll], "o-", label="cached rollout / recompute loop")
    ax.plot(hs, [r["flop_ratio"] for r in roll], "s--", color="#999999", label="FLOP ratio")
    ax.axhline(15, color="#c0392b", ls=":", lw=1, label="15x at H = 30 (target)")
    ax.set_xlabel("steps H")
    ax.set_title(f"AC rollout, B = {roll[0]['batch']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
