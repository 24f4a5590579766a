"""Plot bench/results/orpheus/orpheus.json -> orpheus.png (RTF and throughput vs streams)."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/orpheus/orpheus.json")
r = json.loads(src.read_text())
fig, ax = plt.subplots(1, 3, figsize=(15, 4))
for key, label, style in (("mstar", "M* (streaming, mesh)", "o-"), ("baseline", "transformers static + SNAC (batch)", "s--")):
    pts = r[key]
    n = [p["streams"] for p in pts]
    ax[0].plot(n, [p["rtf_p50"] for p in pts], style, label=label)
    ax[1].plot(n, [p["audio_s_per_s"] for p in pts], style, label=label)
    ax[2].plot(n, [p["ttfa_p50_s"] for p in pts], style, label=label)
ax[0].axhline(1.0, color="k", lw=0.8)
ax[0].set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="RTF p50 (wall / audio)", title="real-time factor (< 1 is real time)")
ax[1].set(xscale="log", xlabel="concurrent streams", ylabel="audio seconds per second", title="throughput")
ax[2].set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="seconds", title="time to first audio p50")
for a in ax:
    a.legend(fontsize=8)
fig.suptitle(f"Orpheus (3B, random bf16) on {r['device']}")
fig.tight_layout()
out = src.with_suffix(".png")
fig.savefig(out, dpi=110)
print(out)
