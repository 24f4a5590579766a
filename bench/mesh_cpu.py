"""CPU per request and per streamed event, by process, for the mesh benchmark's workloads.

Reads utime+stime of every service process (and of this client process) from /proc
around two workloads of bench/mesh.py on the toy model (SHM transport):
- ``latency``: round trips (prompt 'hi', max_tokens=2) at N concurrent gRPC clients;
- ``events``: streams of a 4096-byte prompt (``--streams``, default 1) through the conductor's gRPC
  API, or through the gateway's NDJSON ``/generate`` (``--gateway``), as bench/mesh.py's events rows.

    python bench/mesh_cpu.py [--clients 64] [--requests 2000] [--repeats 1] [--py-spy SERVICE,...]
    python bench/mesh_cpu.py --skip-latency --gateway --streams 8 --repeats 3   # 8 streams via the gateway

``--py-spy A,B`` samples those services (py-spy raw output in /tmp/mesh_cpu-A.txt ...)
during the workload named by ``--spy-workload``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mesh import cpu_s, events_gateway, events_grpc, latency, launch  # noqa: E402


def snapshot(mesh) -> dict[str, float]:
    out = {s.name: cpu_s(s.proc.pid) for s in mesh.services}
    out["client"] = cpu_s(os.getpid())
    return out


def per_unit(before: dict, after: dict, units: int) -> dict[str, float]:
    """Microseconds of CPU per unit, by process."""
    return {k: round(1e6 * (after[k] - before[k]) / units, 1) for k in before}


def spy(mesh, args) -> list[subprocess.Popen]:
    spies = []
    for name in args.py_spy.split(",") if args.py_spy else []:
        pid = next(s.proc.pid for s in mesh.services if s.name == name)
        mode = ["--native"] if args.native else ["--nonblocking"]
        spies.append(subprocess.Popen(["py-spy", "record", "-r", "250", *mode, "-f", "raw", "-o",
                                       f"/tmp/mesh_cpu-{name}.txt", "-p", str(pid)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    if spies:
        time.sleep(1.0)
    return spies


def unspy(spies: list[subprocess.Popen]) -> None:
    for p in spies:
        p.send_signal(2)
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--py-spy", default=None, help="service name to sample during the latency workload")
    ap.add_argument("--spy-workload", choices=["latency", "events"], default="latency")
    ap.add_argument("--native", action="store_true", help="py-spy --native (C frames too; pauses the process)")
    ap.add_argument("--skip-events", action="store_true")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--streams", type=int, default=1, help="concurrent streams of the events workload")
    ap.add_argument("--gateway", action="store_true", help="events through the gateway (NDJSON) instead of gRPC")
    args = ap.parse_args()
    mesh = launch("SHM")
    try:
        addr = mesh.conductor_address
        prompt = ("The quick brown fox jumps over the lazy dog. " * 100)[:4096]
        asyncio.run(latency(addr, args.clients, 200))  # warm-up
        for _ in range(args.repeats):
            if not args.skip_latency:
                spies = spy(mesh, args) if args.spy_workload == "latency" else []
                b = snapshot(mesh)
                r = asyncio.run(latency(addr, args.clients, args.requests))
                a = snapshot(mesh)
                unspy(spies)
                n = r["requests"] + 50  # latency() warms up with 50 requests on its own channel
                print(json.dumps({"workload": f"latency x{args.clients}", "p50_ms": round(r["p50_ms"], 2),
                                  "req_per_s": round(r["requests_per_s"], 1), "cpu_us_per_request": per_unit(b, a, n)}))
            if args.skip_events:
                continue
            spies = spy(mesh, args) if args.spy_workload == "events" else []
            b = snapshot(mesh)
            if args.gateway:
                r = asyncio.run(events_gateway(mesh.url, args.streams, prompt))
            else:
                r = asyncio.run(events_grpc(addr, args.streams, prompt))
            a = snapshot(mesh)
            unspy(spies)
            n = r["events"] + 64  # the warm-up request: max_tokens=64 on a 64-byte prompt, about as many events
            cpu = per_unit(b, a, n)
            print(json.dumps({"workload": f"events x{args.streams} {r['path']}", "events_per_s": round(r["events_per_s"], 1),
                              "cpu_us_per_event": {**cpu, "total": round(sum(cpu.values()), 1)}}))
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
