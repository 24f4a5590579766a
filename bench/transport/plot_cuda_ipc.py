"""Plot bench/transport/cuda_ipc_bench.py's JSON next to it (same name, .png)."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

path = Path(sys.argv[1])
data = json.loads(path.read_text())
fig, (ax, rx) = plt.subplots(2, 1, figsize=(6.5, 6.5), gridspec_kw={"height_ratios": [3, 1.3]})
labels = {"cuda_ipc": "CUDA IPC (AUTO): device → device",
          "host_shm": "host round trip (SHM forced): D→H, shm, H→D"}
for name, pts in data["runs"].items():
    ax.plot([p["bytes"] for p in pts], [p["gb_per_s"] for p in pts], "o-", label=labels.get(name, name))
if "d2d_copy" in data:
    pts = data["d2d_copy"]
    ax.plot([p["bytes"] for p in pts], [p["gb_per_s"] for p in pts], "k--", lw=1, alpha=0.6,
            label="one device copy_ in one process (reference)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tensor bytes")
ax.set_ylabel("GB/s (send → in receiver's GPU memory, median)")
ax.set_title(f"two processes, one GPU, through Link / gRPC\n{data['device']}", fontsize=9)
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=8)
ratios = data["ratio_cuda_ipc_over_host_shm"]
rx.bar(range(len(ratios)), [r["ratio"] for r in ratios], color="tab:green")
rx.set_xticks(range(len(ratios)))
rx.set_xticklabels([f"{r['bytes'] >> 10} KiB" if r["bytes"] < 1 << 20 else f"{r['bytes'] >> 20} MiB" for r in ratios],
                   fontsize=8)
rx.set_yscale("log")
rx.axhline(1, color="k", lw=0.8, alpha=0.5)
rx.set_ylabel("IPC / host ×")
rx.set_xlabel("tensor bytes")
for i, r in enumerate(ratios):
    rx.annotate(f"{r['ratio']:.0f}×" if r["ratio"] >= 10 else f"{r['ratio']:.1f}×", (i, r["ratio"]), ha="center", va="bottom", fontsize=8)
fig.tight_layout()
fig.savefig(path.with_suffix(".png"), dpi=120)
print(f"wrote {path.with_suffix('.png')}")
