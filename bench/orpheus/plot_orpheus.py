"""Plot bench_orpheus.py results: RTF, throughput and time to first audio vs streams.

    python bench/orpheus/plot_orpheus.py                       # results/orpheus/orpheus.json -> orpheus.png
    python bench/orpheus/plot_orpheus.py A.json B.json --out C.png   # M* series of several runs side by side

Each file's M* series is labelled with its placement and model kwargs; a file's baseline
series is drawn when it has one.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(r: dict) -> str:
    kw = ", ".join(f"{k}={v}" for k, v in (r.get("model_kwargs") or {}).items())
    return f"M* {r.get('placement', 'split')}" + (f" ({kw})" if kw else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", default=["bench/results/orpheus/orpheus.json"])
    ap.add_argument("--out", help="PNG path (default: the first file's, .png)")
    args = ap.parse_args()
    runs = [json.loads(Path(f).read_text()) for f in args.files]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3)
    for f, r in zip(args.files, runs, strict=True):
        tag = f" [{Path(f).stem}]" if len(runs) > 1 else ""  # several runs: name each by its file
        series = [(r["mstar"], label(r) + tag, "o-")]
        if r.get("baseline"):
            series.append((r["baseline"], "transformers static + SNAC (batch)" + tag, "s--"))
        for pts, name, style in series:
            n, c = [p["streams"] for p in pts], next(colors)
            ax[0].plot(n, [p["rtf_p50"] for p in pts], style, color=c, label=name + " p50")
            if "rtf_max" in pts[0]:
                ax[0].plot(n, [p["rtf_max"] for p in pts], ":", color=c, alpha=0.6, label=name + " max")
            ax[1].plot(n, [p["audio_s_per_s"] for p in pts], style, color=c, label=name)
            ax[2].plot(n, [p["ttfa_p50_s"] for p in pts], style, color=c, label=name)
    ax[0].axhline(1.0, color="k", lw=0.8)
    ax[0].set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="RTF (wall / audio)",
              title="real-time factor (< 1 is real time)")
    ax[1].set(xscale="log", xlabel="concurrent streams", ylabel="audio seconds per second", title="throughput")
    ax[2].set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="seconds", title="time to first audio p50")
    for a in ax:
        a.legend(fontsize=7)
    fig.suptitle(f"Orpheus (3B, random bf16) on {runs[0]['device']}")
    fig.tight_layout()
    out = Path(args.out) if args.out else Path(args.files[0]).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
