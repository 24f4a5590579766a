"""π0.5 served: one action chunk per request through the mesh, over gRPC (``Conductor.Act``) and
through the gateway (``POST /generate``, raw float32 answer), as a robot calls it.

`mstar serve`'s processes (conductor, gateway, one node-group service with the vision encoder, the
prefix LM and the action expert on one GPU: ``models/pi05/configs/default.yaml``) started by the
launcher on a full-size random checkpoint written in the real layout (bf16, the demo tokenizer and
an 8-dimensional robot's statistics), 3 cameras as 224 px JPEGs, a task, 8 state values, a seed.
Sequential requests at one client (latency: p50 / p90 after ``--warmup``; the mean host time of each
node's batches from the mesh's metrics), then ``--concurrency`` clients at once over gRPC (action
chunks per second). JSON to ``--out``.

    python bench/pi05/bench_served.py --out bench/results/pi05/served.json
    python bench/pi05/bench_served.py --tiny --device cpu --out /tmp/served.json   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

CHECKPOINT = "bench/pi05"
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
TASK = "pick up the red cube and put it in the bowl"


def jpeg(seed: int, size: int = 224) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)  # smooth: a photo-like JPEG
    buf = io.BytesIO()
    Image.fromarray(small).resize((size, size), Image.BILINEAR).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def write_checkpoint(root: Path, tiny: bool) -> Path:
    import torch

    from mstar.models.pi05.config import Pi05Config, tiny_config
    from mstar.models.pi05.demo import write_demo_checkpoint

    d = root / CHECKPOINT
    if not (d / "config.json").exists():
        write_demo_checkpoint(d, tiny_config() if tiny else Pi05Config(max_token_len=200),
                              dtype=torch.float32 if tiny else torch.bfloat16)
    return d


def start_mesh(root: Path, ckpt: Path, device: str, torch_profile: str | None = None):
    from mstar.config import load_config
    from mstar.launcher import LaunchOptions, Mesh

    cfg = root / "pi05.yaml"
    cfg.write_text(json.dumps({"model": "pi05", "model_kwargs": {"checkpoint": str(ckpt)},
                               "node_groups": [{"name": "pi05", "node_names": ["vit_encoder", "llm_prefix", "action_expert"],
                                                "ranks": [0]}]}))
    mesh = Mesh(load_config(cfg), LaunchOptions(cfg, port=0, grpc_port=0, gpus=[0] if device == "cuda" else None,
                                                cache_dir=str(root), log_level="WARNING", startup_timeout_s=900,
                                                torch_profile=torch_profile))
    mesh.start()
    return mesh


def profiled(mesh, folder: Path, requests: int) -> dict:
    """``requests`` more at one client while the node group and the conductor record torch.profiler
    traces (``record_around``). Their latencies (the profiler slows the host side) and the files."""
    from mstar.torch_profile import record_around

    def run() -> dict:
        return asyncio.run(grpc_levels(mesh.conductor_address, requests, 0, [], {}))["grpc_1"]
    out, files = record_around(list(mesh.profiled_pids().values()), folder, run)
    return out | {"files": files}


def act_request(seed: int):
    from mstar.v1 import conductor_pb2 as cpb

    images = [cpb.CameraImage(name=n, data=jpeg(i), mime_type="image/jpeg") for i, n in enumerate(CAMERAS)]
    return cpb.ActRequest(model="pi05", task=TASK, images=images, state=[0.1 * i for i in range(8)], seed=seed)


def scrape(urls: dict[str, str]) -> dict[str, float]:
    """Every ``_sum`` / ``_count`` series of the mesh's duration histograms, by service and labels."""
    import urllib.request

    out = {}
    for service, url in urls.items():
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(("mstar_node_group_step_seconds_", "mstar_request_duration_seconds_",
                                    "mstar_time_to_first_output_seconds_")) and ("_sum" in line or "_count" in line):
                    name, value = line.rsplit(" ", 1)
                    out[f"{service}:{name}"] = float(value)
    return out


def step_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms of each histogram over the requests between two scrapes (host time of each node's
    batches, routing included; the conductor's end-to-end)."""
    means = {}
    for key, total in after.items():
        if "_sum" in key:
            count_key = key.replace("_sum", "_count")
            n = after.get(count_key, 0) - before.get(count_key, 0)
            if n:
                means[key.replace("_sum", "")] = (total - before.get(key, 0.0)) / n * 1e3
    return means


def summary(times: list[float]) -> dict:
    s = sorted(times)
    return {"n": len(s), "p50_ms": statistics.median(s) * 1e3, "p90_ms": s[int(0.9 * (len(s) - 1))] * 1e3,
            "min_ms": s[0] * 1e3, "max_ms": s[-1] * 1e3}


async def grpc_levels(address: str, requests: int, warmup: int, concurrency: list[int],
                      metrics_urls: dict[str, str]) -> dict:
    """One client's requests in turn (with each node's mean host time over them, from the mesh's
    metrics), then each level of ``concurrency``."""
    import grpc

    from mstar.services.links import CHANNEL_OPTIONS
    from mstar.v1 import conductor_pb2_grpc

    out = {}
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        req = act_request(seed=0)
        times, server = [], []
        before = scrape(metrics_urls)
        for i in range(warmup + requests):
            t0 = time.perf_counter()
            reply = await stub.Act(req, timeout=300)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                server.append(reply.timings.total_s)
        out["grpc_1"] = summary(times) | {"server_total_p50_ms": statistics.median(server) * 1e3,
                                          "actions_shape": list(reply.actions.shape)}
        out["grpc_1_step_ms"] = step_means(before, scrape(metrics_urls))
        for c in concurrency:
            async def one():
                t0 = time.perf_counter()
                await stub.Act(req, timeout=300)
                return time.perf_counter() - t0
            await asyncio.gather(*(one() for _ in range(c)))  # warm this batch size
            t0 = time.perf_counter()
            lat = [x for _ in range(max(1, requests // c)) for x in await asyncio.gather(*(one() for _ in range(c)))]
            wall = time.perf_counter() - t0
            out[f"grpc_{c}"] = summary(lat) | {"concurrency": c, "chunks_per_s": len(lat) / wall}
    return out


async def gateway_level(url: str, requests: int, warmup: int) -> dict:
    import aiohttp

    def form():
        f = aiohttp.FormData()
        f.add_field("model", "pi05")
        f.add_field("text", TASK)
        f.add_field("model_kwargs", json.dumps({"state": [0.1 * i for i in range(8)], "seed": 0}))
        for i, n in enumerate(CAMERAS):
            f.add_field(n, jpeg(i), filename=f"{n}.jpg", content_type="image/jpeg")
        return f

    times = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for i in range(warmup + requests):
            data = form()
            t0 = time.perf_counter()
            async with http.post(f"{url}/generate", data=data, headers={"Accept": "application/octet-stream"}) as r:
                body = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"gateway: {r.status} {body[:200]!r}")
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return {"gateway_1": summary(times) | {"bytes": len(body)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny demo shapes (CPU smoke test)")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--concurrency", default="4,16")
    ap.add_argument("--torch-profile", metavar="DIR", help="the node group's torch.profiler trace into DIR (mstar "
                    "serve --torch-profile) over --requests more at one client after the timed levels; summarise it "
                    "with bench/trace_gaps.py")
    ap.add_argument("--root", help="where the checkpoint is written (default: a temporary folder)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root or tmp)
        t0 = time.perf_counter()
        ckpt = write_checkpoint(root, args.tiny)
        result = {"device": args.device, "tiny": args.tiny, "cameras": len(CAMERAS), "checkpoint_s": time.perf_counter() - t0}
        if args.device == "cuda":
            import torch

            result["device"] = torch.cuda.get_device_name(0)
        t0 = time.perf_counter()
        if args.torch_profile:  # the bench's own SIGUSR1 pair ends the recording, not a window
            os.environ.setdefault("MSTAR_TORCH_PROFILE_S", "3600")
        mesh = start_mesh(root, ckpt, args.device, args.torch_profile)
        result["startup_s"] = time.perf_counter() - t0
        try:
            gateway = next(s for s in mesh.services if s.kind == "gateway")
            levels = [int(c) for c in args.concurrency.split(",") if c]
            result |= asyncio.run(grpc_levels(mesh.conductor_address, args.requests, args.warmup, levels,
                                              mesh.metrics_urls()))
            if args.torch_profile:
                result["profiled"] = profiled(mesh, Path(args.torch_profile), args.requests)
            result |= asyncio.run(gateway_level(f"http://{gateway.address}", args.requests, args.warmup))
        finally:
            mesh.stop()
        print(json.dumps(result, indent=1))
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
