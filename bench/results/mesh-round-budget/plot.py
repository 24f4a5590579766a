"""Events/s and 64-client requests/s per run of the round-budget A/B (this folder's JSON files).

    python bench/results/mesh-round-budget/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
runs = sorted(HERE.glob("*.json"))
fig, axes = plt.subplots(1, 5, figsize=(16, 3.6))
metrics = [("events/s, gRPC, 1 stream", ("grpc", 1)), ("events/s, gRPC, 8 streams", ("grpc", 8)),
           ("events/s, gateway, 1 stream", ("gateway", 1)), ("events/s, gateway, 8 streams", ("gateway", 8)),
           ("requests/s, 64 clients", None)]
for ax, (title, key) in zip(axes, metrics, strict=True):
    for budget, color in (("0", "tab:blue"), ("0.0005", "tab:orange"), ("0.0002", "tab:green")):
        ys = []
        for f in runs:
            if f.stem.split("-")[1] != budget:
                continue
            d = json.loads(f.read_text())
            if key is None:
                ys.append(next(x["requests_per_s"] for x in d["latency"] if x["clients"] == 64))
            else:
                ys.append(next(x["events_per_s"] for x in d["events"] if (x["path"], x["streams"]) == key))
        ax.plot([budget] * len(ys), ys, "o", color=color)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("MSTAR_ROUND_BUDGET_S")
    ax.set_ylim(bottom=0)
fig.suptitle("round budget A/B on the 2-core VM, one dot per run (runs interleaved)", fontsize=10)
fig.tight_layout()
fig.savefig(HERE / "round_budget.png", dpi=100)
