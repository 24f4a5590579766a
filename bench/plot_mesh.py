"""Plot bench/results/mesh.json -> bench/results/mesh.png (needs matplotlib)."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/mesh.json")
r = json.loads(src.read_text())
fig, ax = plt.subplots(1, 3, figsize=(15, 4))
lat = r["latency"]
c = [x["clients"] for x in lat]
ax[0].plot(c, [x["p50_ms"] for x in lat], "o-", label="p50")
ax[0].plot(c, [x["p99_ms"] for x in lat], "o-", label="p99")
if "raw_grpc" in r:
    ax[0].plot([x["clients"] for x in r["raw_grpc"]], [x["p50_ms"] for x in r["raw_grpc"]], "k--", label="bare gRPC p50")
ax[0].set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="round trip (ms)", title="request latency")
ax[0].legend()
ax[1].plot(c, [x["requests_per_s"] for x in lat], "o-", label="M* toy request")
if "raw_grpc" in r:
    ax[1].plot([x["clients"] for x in r["raw_grpc"]], [x["requests_per_s"] for x in r["raw_grpc"]], "k--", label="bare gRPC call")
ax[1].set(xscale="log", xlabel="concurrent clients", ylabel="requests/s", title="throughput")
ax[1].legend()
for proto in ("TCP", "SHM"):
    pts = [x for x in r["transfer"] if x["protocol"] == proto]
    ax[2].plot([x["bytes"] for x in pts], [x["gb_per_s"] for x in pts], "o-", label={"TCP": "inline (gRPC bytes)", "SHM": "shared memory"}[proto])
ax[2].set(xscale="log", yscale="log", xlabel="tensor bytes", ylabel="GB/s", title="service-to-service transfer")
ax[2].legend()
fig.suptitle(f"M* mesh on {r['machine']['cpu']} ({r['machine']['cores']} cores)")
fig.tight_layout()
out = src.with_suffix(".png")
fig.savefig(out, dpi=110)
print(out)
