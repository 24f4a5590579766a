"""Plot decode_bench.json: step time per batch size, ours vs transformers static vs roofline,
the same run's engines with a changed EngineConfig (``--compare-config``), and optionally an
earlier run of ours (its own run: compare its ratios, not its absolute times).

    python bench/engines/plot_decode.py bench/results/engines/2026-11-26b/decode_bench.json \
        bench/results/engines/2026-11-26b/decode.png [OLDER/decode_bench.json]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str, before: str | None = None) -> None:
    r = json.load(open(src))
    batches = sorted(int(b) for b in r["ours"])
    ours = [r["ours"][str(b)]["decode_step_ms_median"] for b in batches]
    floor = [r["ours"][str(b)]["roofline_floor_ms"] for b in batches]
    hf_b = [b for b in batches if "step_ms" in r.get("hf_static", {}).get(str(b), {})]
    hf = [r["hf_static"][str(b)]["step_ms"] for b in hf_b]
    nov_b = sorted(int(b) for b in r.get("ours_no_overlap", {}))
    nov = [r["ours_no_overlap"][str(b)]["decode_step_ms_median"] for b in nov_b]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(batches, ours, "o-", label="ours (CUDA graphs + pipelined)")
    a.plot(nov_b, nov, "s:", label="ours, not pipelined")
    a.plot(hf_b, hf, "^-", label='transformers generate, cache="static"')
    a.plot(batches, floor, "k--", label="roofline floor (weights + KV / HBM bw)")
    for res in r.values():  # same-run engines with one EngineConfig change (--compare-config)
        if isinstance(res, dict) and "config_change" in res:
            cb = sorted(int(k) for k, v in res.items() if k.isdigit() and "decode_step_ms_median" in v)
            a.plot(cb, [res[str(x)]["decode_step_ms_median"] for x in cb], "d:",
                   label="same run, " + (", ".join(f"{k}={v}" for k, v in res["config_change"].items())
                                         or "the default engine again"))
    if before:
        old = json.load(open(before))["ours"]
        ob = sorted(int(b) for b in old)
        a.plot(ob, [old[str(b)]["decode_step_ms_median"] for b in ob], "x:", color="grey",
               label="ours, previous record (its own run)")
    a.set_xscale("log", base=2)
    a.set_xlabel("batch size")
    a.set_ylabel("decode step, ms (median)")
    a.set_ylim(bottom=0)
    a.legend(fontsize=8)
    a.set_title(f"Llama-3.2-3B shape, bf16, {r['device']}", fontsize=9)
    b.plot(batches, [r["ours"][str(x)]["decode_tok_s"] for x in batches], "o-", label="ours")
    b.plot(hf_b, [r["hf_static"][str(x)]["tok_s"] for x in hf_b], "^-", label="transformers static")
    b.set_xscale("log", base=2)
    b.set_xlabel("batch size")
    b.set_ylabel("decode tokens / s")
    b.legend(fontsize=8)
    b.set_title("prompt 64, 256 new tokens, sampling", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:4])
