"""GB/s between two node-group services on two "hosts" (network namespaces joined by a
veth pair, tests/netns/twohosts.py): inline bytes in gRPC frames vs Mooncake over TCP, 64 KiB to
256 MiB, measured from the tensor leaving node group 'front' to it arriving in 'back'
(the toy model's relay walk). Needs root.

    python bench/transport/netns_bench.py --out bench/results/transport/netns.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "netns"))  # the two-host harness is a test helper, not in the package

from mstar.services.transport import mooncake  # noqa: E402

from twohosts import TwoHosts  # noqa: E402

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    protocols = ["TCP"] + (["RDMA"] if mooncake.available() else [])
    if len(protocols) == 1:
        print(f"Mooncake not available ({mooncake.unavailable_reason()}): inline only", file=sys.stderr)
    result = {"command": " ".join(["python", *sys.argv]), "host": platform.node(), "cpus": os.cpu_count(),
              "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), ""),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sizes": SIZES, "runs": {}}
    hosts = TwoHosts().create()
    try:
        for proto in protocols:
            mesh = hosts.start_mesh(str(ROOT / "models" / "toy" / "configs" / "two_hosts.yaml"), proto)
            r = hosts.tool("a", "relay", mesh["addresses"]["conductor"], ",".join(map(str, SIZES)), str(args.repeats),
                           timeout=1200)
            name = "inline" if proto == "TCP" else "mooncake_tcp"
            result["runs"][name] = r["points"]
            for pt in r["points"]:
                print(f"{name:13s} {pt['bytes']:>10d} B  {pt['gb_per_s']:.3f} GB/s  ({pt['median_s'] * 1e3:.2f} ms)", flush=True)
            hosts.stop_all()
    finally:
        hosts.destroy()
    if "mooncake_tcp" in result["runs"]:
        result["ratio_mooncake_over_inline"] = [
            {"bytes": a["bytes"], "ratio": b["gb_per_s"] / a["gb_per_s"]}
            for a, b in zip(result["runs"]["inline"], result["runs"]["mooncake_tcp"], strict=True)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    subprocess.run([sys.executable, str(Path(__file__).with_name("plot_netns.py")), args.out], check=False)


if __name__ == "__main__":
    main()
