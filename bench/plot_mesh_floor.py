"""Plot bench/results/mesh-floor/: the mesh against its floor (bench/mesh_floor.py) and the issue's
targets -> bench/results/mesh-floor/floor.png (needs matplotlib)."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

folder = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/mesh-floor")
runs = {"M* mesh (toy)": "mesh.json", "floor": "floor.json", "floor, walks chained": "floor-chained.json",
        "floor, Unix sockets": "floor-uds.json"}
runs = {k: json.loads((folder / v).read_text()) for k, v in runs.items() if (folder / v).exists()}


def events_per_s(path: str, streams: int):
    return lambda r: next(e for e in r["events"] if e["path"] == path and e["streams"] == streams)["events_per_s"]


panels = [  # (title, value of a run, target, higher is better)
    ("p50 round trip, 1 client (ms)", lambda r: r["latency"][0]["p50_ms"], 2.0, False),
    ("requests/s, 64 clients", lambda r: r["latency"][2]["requests_per_s"], 1000.0, True),
    ("events/s, gRPC, 8 streams", events_per_s("grpc", 8), 20000.0, True),
    ("events/s, gateway, 8 streams", events_per_s("gateway", 8), 20000.0, True),
]
fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4))
for ax, (title, value, target, higher) in zip(axes, panels, strict=True):
    names = list(runs)
    values = [value(runs[n]) for n in names]
    ax.bar(range(len(names)), values, color=["tab:red"] + ["tab:gray"] * (len(names) - 1))
    ax.axhline(target, color="k", ls="--", label=f"target ({'≥' if higher else '≤'} {target:g})")
    ax.set_ylim(0, 1.3 * max(*values, target))  # room for the legend above the bars
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
m = next(iter(runs.values()))["machine"]
fig.suptitle(f"The toy mesh vs the same message pattern with no runtime (its floor), {m['cores']}-core {m['cpu']}", fontsize=10)
fig.tight_layout()
out = folder / "floor.png"
fig.savefig(out, dpi=110)
print(out)
