"""Plot bench/transport/netns_bench.py's JSON next to it (same name, .png)."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

path = Path(sys.argv[1])
data = json.loads(path.read_text())
fig, ax = plt.subplots(figsize=(6, 4))
labels = {"inline": "inline (bytes in gRPC frames)", "mooncake_tcp": "Mooncake over TCP"}
for name, pts in data["runs"].items():
    ax.plot([p["bytes"] for p in pts], [p["gb_per_s"] for p in pts], "o-", label=labels.get(name, name))
ax.set_xscale("log", base=2)
ax.set_xlabel("tensor bytes")
ax.set_ylabel("GB/s (front → back, median)")
ax.set_title(f"two network namespaces over veth, {data['cpus']} cores")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(path.with_suffix(".png"), dpi=120)
print(f"wrote {path.with_suffix('.png')}")
