"""Mesh benchmark on this machine: the toy model served by real processes on loopback.

Measures (results as JSON, see bench/results/README.md):
- request round-trip latency p50/p99 and requests/s at 1, 16, 64 concurrent gRPC clients;
- streamed events/s through the conductor (gRPC) and through the gateway (NDJSON);
- tensor transfer GB/s between two node-group services, inline bytes vs shared memory.

    python bench/mesh.py --out bench/results/mesh.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mstar import grpc_env  # the services' grpc settings, for this process too

grpc_env.apply()  # before grpc is imported

import aiohttp
import grpc
from prometheus_client.parser import text_string_to_metric_families

from mstar import wire
from mstar.config import load_config
from mstar.launcher import LaunchOptions, Mesh
from mstar.services.links import CHANNEL_OPTIONS
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "models" / "toy" / "configs" / "default.yaml"
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def launch(protocol: str) -> Mesh:
    mesh = Mesh(load_config(CONFIG), LaunchOptions(CONFIG, port=0, grpc_port=0, protocol=protocol, log_level="WARNING"))
    mesh.start()
    return mesh


def req(text: str, **kw) -> cpb.GenerateRequest:
    return cpb.GenerateRequest(model="toy", text=text, model_kwargs_json=json.dumps(kw))


async def one(stub, r) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    async for resp in stub.Generate(r, timeout=60):
        n += len(resp.chunks)
    return time.perf_counter() - t0, n


WARMUP = 50


async def latency(address: str, clients: int, total: int) -> dict:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        for _ in range(WARMUP):
            await one(stub, req("hi", max_tokens=2))
        lat: list[float] = []
        per_client = total // clients

        async def client():
            for _ in range(per_client):
                lat.append((await one(stub, req("hi", max_tokens=2)))[0])

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"clients": clients, "requests": len(lat), "p50_ms": 1e3 * lat[len(lat) // 2],
            "p99_ms": 1e3 * lat[int(len(lat) * 0.99) - 1], "mean_ms": 1e3 * statistics.fmean(lat),
            "requests_per_s": len(lat) / wall}


async def events_grpc(address: str, streams: int, prompt: str) -> dict:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        await one(stub, req(prompt[:64], max_tokens=64))
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(stub, req(prompt, max_tokens=len(prompt))) for _ in range(streams)))
        wall = time.perf_counter() - t0
    events = sum(n for _, n in res)
    return {"path": "grpc", "streams": streams, "events": events, "seconds": wall, "events_per_s": events / wall}


async def events_gateway(url: str, streams: int, prompt: str) -> dict:
    async def stream(session, text: str = prompt) -> int:
        body = {"model": "toy", "text": text, "model_kwargs": {"max_tokens": len(text)}, "stream": True}
        n = 0
        async with session.post(f"{url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.strip():
                    n += 1
        return n

    async with aiohttp.ClientSession() as session:
        await stream(session, prompt[:64])  # warm-up, as events_grpc's
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(stream(session) for _ in range(streams)))
        wall = time.perf_counter() - t0
    events = sum(counts)
    return {"path": "gateway", "streams": streams, "events": events, "seconds": wall, "events_per_s": events / wall}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_cpu(pids: list[int], run) -> dict:
    """``run()``'s result (an events_* row) with the CPU all of ``pids`` used meanwhile, per
    event and in cores (the warm-up stream included: 64 tokens of thousands)."""
    c0, t0 = sum(map(cpu_s, pids)), time.perf_counter()
    r = run()
    cpu, wall = sum(map(cpu_s, pids)) - c0, time.perf_counter() - t0
    r["cpu_us_per_event"], r["cpu_cores_busy"] = 1e6 * cpu / r["events"], cpu / wall
    return r


async def transfer(address: str, protocol: str, repeats: int) -> list[dict]:
    out = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        for size in SIZES:
            secs = []
            for i in range(repeats + 2):
                chunk = None
                async for r in stub.Generate(req("x", relay_bytes=size), timeout=60):
                    chunk = r.chunks[0] if r.chunks else chunk
                n, seconds, _ = wire.from_proto(chunk.tensor).tolist()
                assert int(n) == size
                if i >= 2:  # two warm-ups: pools and mappings exist after them
                    secs.append(seconds)
            med = statistics.median(secs)
            out.append({"protocol": protocol, "bytes": size, "median_s": med, "gb_per_s": size / med / 1e9,
                        "samples": len(secs)})
    return out


def link_totals(mesh: Mesh) -> tuple[int, int]:
    """gRPC messages and frames written on every link of the mesh so far (the services'
    ``mstar_link_messages`` / ``mstar_link_frames`` counters)."""
    totals = {"mstar_link_messages_total": 0.0, "mstar_link_frames_total": 0.0}
    for name, url in mesh.metrics_urls().items():
        if name == "gateway":  # it writes no frames
            continue
        with urllib.request.urlopen(url, timeout=5) as r:
            for fam in text_string_to_metric_families(r.read().decode()):
                for smp in fam.samples:
                    if smp.name in totals:
                        totals[smp.name] += smp.value
    return int(totals["mstar_link_messages_total"]), int(totals["mstar_link_frames_total"])


def latency_with_links(mesh: Mesh, clients: int, total: int) -> dict:
    """``latency`` plus the mesh's gRPC messages (and frames) per request, warm-ups included."""
    m0, f0 = link_totals(mesh)
    r = asyncio.run(latency(mesh.conductor_address, clients, total))
    m1, f1 = link_totals(mesh)
    n = r["requests"] + WARMUP
    r["link_messages_per_request"], r["link_frames_per_request"] = (m1 - m0) / n, (f1 - f0) / n
    return r


def raw_grpc(counts) -> list[dict]:
    """The same client loop against a server that does no work (bench/bare_grpc_server.py)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "bare_grpc_server.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{proc.stdout.readline().strip()}"
        return [asyncio.run(latency(address, c, n)) for c, n in counts]
    finally:
        proc.stdin.close()
        proc.wait(10)


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "commit": commit,
            "grpcio": grpc.__version__, "GRPC_EXPERIMENTS": os.environ.get("GRPC_EXPERIMENTS")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mesh.json"))
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, not for the record)")
    args = ap.parse_args()
    scale = 0.1 if args.quick else 1.0
    result: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
                    "workload": "toy model, default config (3 node groups + conductor + gateway as processes); "
                                "latency requests: prompt 'hi', max_tokens=2 (2 walks + 6 chunk walks, 8 output events)"}
    counts = [(c, int(n * scale)) for c, n in ((1, 1000), (16, 4000), (64, 8000))]
    result["raw_grpc"] = raw_grpc(counts)
    mesh = launch("SHM")
    try:
        result["latency"] = [latency_with_links(mesh, c, n) for c, n in counts]
        prompt = ("The quick brown fox jumps over the lazy dog. " * 100)[:4096]
        pids = [s.proc.pid for s in mesh.services] + [os.getpid()]
        result["events"] = [with_cpu(pids, lambda s=s: asyncio.run(events_grpc(mesh.conductor_address, s, prompt)))
                            for s in (1, 8)]
        result["events"] += [with_cpu(pids, lambda s=s: asyncio.run(events_gateway(mesh.url, s, prompt)))
                             for s in (1, 8)]
        result["transfer"] = asyncio.run(transfer(mesh.conductor_address, "SHM", max(3, int(10 * scale))))
    finally:
        mesh.stop()
    mesh = launch("TCP")
    try:
        result["transfer"] += asyncio.run(transfer(mesh.conductor_address, "TCP", max(3, int(10 * scale))))
    finally:
        mesh.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
