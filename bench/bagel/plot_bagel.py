"""Plot bench_bagel.py records: ours served against the reference inferencer (one call's
``bagel_1gpu.json`` + ``bagel_reference.json``) and, when given, the CFG layouts on one, two and
three GPUs or split by rows over two and three (``bagel_multi_gpu.json``, or ``layouts.json`` of
``--parts compare``), as seconds per request.

    python bench/bagel/plot_bagel.py --one DIR/bagel_1gpu.json --reference DIR/bagel_reference.json \
        [--multi DIR2/bagel_multi_gpu.json] --out plot.png
"""

from __future__ import annotations

import argparse
import json

#: layouts in plotting order, and their labels
LAYOUTS = {"one_gpu": "one GPU", "two_gpus": "CFG branches\non 2", "three_gpus": "CFG branches\non 3",
           "two_gpus_sp": "rows split\nover 2", "three_gpus_sp": "rows split\nover 3"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", required=True, help="bagel_1gpu.json (--parts served)")
    ap.add_argument("--reference", required=True, help="bagel_reference.json of the same call")
    ap.add_argument("--multi", help="bagel_multi_gpu.json (--parts multi_gpu) or layouts.json (--parts compare)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ours = json.load(open(args.one))["ours_served"]
    ref = json.load(open(args.reference))["reference"]
    size = next(k for k in ours if k.startswith("t2i_"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if args.multi else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 1, 4), squeeze=False)
    a = axes[0][0]
    names = [f"text-to-image {size[4:]}²", "editing", "understanding TTFT"]
    mine = [ours[size], ours["edit"], ours["understand_c1"]["ttft_median_s"]]
    theirs = [ref[size]["median_s"], ref["edit"]["median_s"], ref["understand_ttft"]["median_s"]]
    xs = range(len(names))
    a.bar([x - 0.2 for x in xs], theirs, 0.4, label="reference InterleaveInferencer")
    a.bar([x + 0.2 for x in xs], mine, 0.4, label="M* served")
    for x, m, t in zip(xs, mine, theirs, strict=True):
        a.text(x + 0.2, m, f"{m / t:.2f}×", ha="center", va="bottom", fontsize=8)
    a.set_xticks(list(xs), names, fontsize=8)
    a.set_yscale("log")
    a.set_ylabel("seconds per request (log)")
    a.set_title("one GPU, same weights, same call")
    a.legend(fontsize=8)
    if args.multi:
        m = json.load(open(args.multi))
        m = m.get("multi_gpu", m)  # a --parts multi_gpu record, or compare's layouts.json
        b = axes[0][1]
        layouts = [k for k in LAYOUTS if k in m]
        for i, task in enumerate(("t2i", "edit")):
            vals = [m[k][task]["median_s"] for k in layouts]
            b.bar([x + (i - 0.5) * 0.4 for x in range(len(layouts))], vals, 0.4,
                  label="text-to-image" if task == "t2i" else "editing")
            for x, v in enumerate(vals):
                b.text(x + (i - 0.5) * 0.4, v, f"{v / vals[0]:.2f}×", ha="center", va="bottom", fontsize=8)
        b.set_xticks(range(len(layouts)), [LAYOUTS[k] for k in layouts], fontsize=7)
        b.set_ylabel("seconds per request")
        b.set_title("over GPUs (served, same call)")
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
