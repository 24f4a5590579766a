"""What one message costs between two Python gRPC processes on this machine, after the sender
was idle for a while: the floor under the mesh's per-hop latency (bench/results/README.md).

A server (in a child process, on uvloop like the services) streams message ``a``, sleeps ``gap``
seconds, then streams ``b`` stamped with ``time.perf_counter()`` (CLOCK_MONOTONIC, one clock for
every process on the host); the client records when ``b`` arrived. Delivery = arrival − stamp.

    python bench/grpc_hop.py --out bench/results/grpc_hop.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from mstar import grpc_env  # the services' grpc settings, for this process too

grpc_env.apply()  # before grpc is imported

import grpc

from mstar.services.grpc_server import run_service
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

GAPS_S = (0.0, 0.001, 0.002, 0.005, 0.02)


class Gap(conductor_pb2_grpc.ConductorServicer):
    async def Generate(self, request, context):
        yield cpb.GenerateResponse(chunks=[cpb.OutputChunk(name="a")])
        await asyncio.sleep(float(request.text))
        yield cpb.GenerateResponse(chunks=[cpb.OutputChunk(name="b", elapsed_s=time.perf_counter())])


async def measure(address: str, samples: int) -> list[dict]:
    out = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        for gap in GAPS_S:
            ms = []
            for _ in range(samples):
                async for r in stub.Generate(cpb.GenerateRequest(text=repr(gap)), timeout=10):
                    now = time.perf_counter()
                    for c in r.chunks:
                        if c.name == "b":
                            ms.append(1e3 * (now - c.elapsed_s))
            ms.sort()
            out.append({"gap_ms": 1e3 * gap, "samples": len(ms), "delivery_ms_p50": ms[len(ms) // 2],
                        "delivery_ms_p90": ms[int(len(ms) * 0.9)], "delivery_ms_min": ms[0]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        from bare_grpc_server import serve

        run_service(serve(Gap()))
        return
    proc = subprocess.Popen([sys.executable, __file__, "--out", "-", "--serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        import uvloop

        rows = uvloop.run(measure(f"127.0.0.1:{line}", args.samples))
    finally:
        proc.stdin.close()
        proc.wait(10)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    result = {"command": " ".join(["python", "bench/grpc_hop.py", *sys.argv[1:]]),
              "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__,
                          "commit": commit},
              "hops": rows}
    for r in rows:
        print(json.dumps(r))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
