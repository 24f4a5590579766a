"""BAGEL on one GPU (issue 31's Benchmark): this repository's model against the public reference
inferencer (github.com/ByteDance-Seed/Bagel, imported from ``--reference``) on the same weights, in
one process. Full-size random bf16 weights in the official layout (``--ckpt``; written there first by
``demo.write_full_checkpoint`` when missing).

Measured (CUDA-synchronised wall time, median of ``--reps`` after ``--warmup``):
- text-to-image at each ``--sizes`` (50 timesteps, default CFG: cfg_text 4 in (0.4, 1], renorm global),
  editing at the first size (cfg_text 4, cfg_img 2, interval [0, 1], text_channel): ours = the
  whole request as the served graph runs it (``BagelPipeline``: the CFG branches of a step in one
  engine pass) and as served through an in-process mesh (gRPC on loopback); reference =
  ``InterleaveInferencer`` (its flash-attn replaced by torch SDPA where it cannot be imported: said
  in the JSON);
- understanding at each ``--concurrency``: time to first token and decoded tokens/s through the
  in-process mesh (requests batched by the node group); the reference serves one request at a time
  (its TTFT: a 1-token answer; its throughput: N-token answers back to back);
- the FLOP floor of text-to-image: FLOPs of one guided and one unguided flow step, the VAE decode
  and the prefill (``torch.utils.flop_counter``), over the bf16 matmul peak measured here;
- ``--parts multi_gpu``: text-to-image at the first size and editing through the mesh in each of
  ``--layouts`` the host has devices for (``LAYOUTS``: the CFG branches on one device, two or three;
  or every pass split by rows over two or three), and the tensor traffic between groups per flow step
  with its transport; the images are written beside ``--out``. ``--parts compare --records A B``:
  those runs' layouts against the one-device one (latency ratios, image differences; same seed).

    python bench/bagel/bench_bagel.py --ckpt /data/bagel-random --reference /work/ref-bagel --out bench/results/bagel/bench.json
    python bench/bagel/bench_bagel.py --device cpu --tiny --out /tmp/bagel.json   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import platform
import statistics
import sys
import time
from pathlib import Path

PROMPT = "a photo of a red cat sitting on a blue chair"
ROOT = Path(__file__).resolve().parents[2]


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int, warmup: int) -> dict:
    times = []
    for i in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": len(times)}


def test_image(w: int, h: int):
    import numpy as np
    from PIL import Image

    yy, xx = np.mgrid[0:h, 0:w]
    return Image.fromarray(np.stack([127 + 120 * np.sin(0.01 * (c + 1) * xx + 0.02 * yy) for c in range(3)], -1).astype(np.uint8))


def bf16_peak_tflops(device: str) -> float | None:
    import torch

    if not device.startswith("cuda"):
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    sync(device)
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        a @ a
    sync(device)
    return 2 * 8192 ** 3 * n / (time.perf_counter() - t0) / 1e12


def flop_floor(pipe, size: int, steps: int, peak: float | None) -> dict:
    """FLOPs of a default text-to-image request, counted on its parts, and the time they take at ``peak``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from mstar.models.bagel.flow import FlowParams, schedule, unpatchify_latent
    from mstar.models.bagel.pipeline import flow_step
    from mstar.services.engines.attention import TorchPagedAttention

    p = FlowParams(size, size, steps)
    lm, rid = pipe.lm, "flops"
    h = w = size // pipe.cfg.latent_downsample
    x = torch.randn(h * w, pipe.cfg.patch_latent_dim)
    counts = {}
    runner = lm.engine.runner
    backend = runner.backend  # counted with torch's attention: the counter does not see FlashInfer's kernels
    runner.backend = TorchPagedAttention(lm.llm.config.heads, lm.device)
    try:
        with FlopCounterMode(display=False) as fc:
            lm.prefill_text([(rid, ("main", "cfg_img"), pipe.text_ids(PROMPT))])
        counts["prefill"] = fc.get_total_flops()
        for name, t in (("guided_step", 0.9), ("plain_step", 0.1)):
            with FlopCounterMode(display=False) as fc:
                flow_step(lm, [(rid, x, t, 0.02, p, ("main", "cfg_text"))])
            counts[name] = fc.get_total_flops()
        with FlopCounterMode(display=False) as fc, torch.inference_mode():
            pipe.vae.decode(unpatchify_latent(x, h, w)[None].to(pipe.device, pipe.dtype))
        counts["vae_decode"] = fc.get_total_flops()
    finally:
        runner.backend = backend
        lm.release(rid)
    ts, _ = schedule(steps, p.shift)
    guided = sum(1 for t in ts.tolist() if p.scales(t)[0] > 1.0)
    total = counts["prefill"] + guided * counts["guided_step"] + (len(ts) - guided) * counts["plain_step"] + counts["vae_decode"]
    return {**counts, "guided_steps": guided, "plain_steps": len(ts) - guided, "total_flops": total,
            "floor_s": total / (peak * 1e12) if peak else None}


# -- the served path: an in-process mesh on this device ------------------------------------------
@contextlib.asynccontextmanager
async def mesh(config_name: str, kwargs: dict, devices: dict[str, str]):
    """The placement's groups and the conductor as gRPC servers on loopback in this process, each
    group on its device (``devices``: group -> device; default the first)."""
    import dataclasses

    import grpc

    from mstar.conductor.replicas import Replicas
    from mstar.conductor.requests import RequestTable
    from mstar.conductor.server import ConductorServer
    from mstar.config import Placement, load_config
    from mstar.models.registry import create_model
    from mstar.ports import free_port
    from mstar.services.links import CHANNEL_OPTIONS
    from mstar.services.node_group.runtime import NodeGroupRuntime
    from mstar.services.node_group.server import NodeGroupServer
    from mstar.services.transport import Protocol
    from mstar.v1 import conductor_pb2_grpc

    cfg = load_config(ROOT / "models/bagel/configs" / f"{config_name}.yaml")
    cfg = dataclasses.replace(cfg, model_kwargs={**cfg.model_kwargs, **kwargs})
    addrs = {g: f"127.0.0.1:{free_port('127.0.0.1')}" for g in cfg.group_names}
    conductor_address = f"127.0.0.1:{free_port('127.0.0.1')}"
    internal_address = f"127.0.0.1:{free_port('127.0.0.1')}"  # the conductor's WalkEvents port: node groups report there
    groups = {}
    for g in cfg.group_names:
        model = create_model("bagel", cfg.model_kwargs)
        runtime = NodeGroupRuntime(g, model, Placement(cfg, model), addrs, internal_address, Protocol.AUTO,
                                   device=devices.get(g, next(iter(devices.values()))))
        groups[g] = NodeGroupServer(addrs[g], runtime)
        await groups[g].start()
    model = create_model("bagel", cfg.model_kwargs)
    model.prepare_conductor()
    conductor = ConductorServer(conductor_address, RequestTable(model, Placement(cfg, model),
                                                                Replicas({g: [a] for g, a in addrs.items()}), Protocol.AUTO),
                                internal_address=internal_address)
    await conductor.start()
    try:
        async with grpc.aio.insecure_channel(conductor_address, options=CHANNEL_OPTIONS) as channel:
            yield conductor_pb2_grpc.ConductorStub(channel)
    finally:
        await asyncio.gather(*(s.runtime.links.close() for s in groups.values()), conductor.table.links.close())
        await asyncio.gather(*(s.stop(grace_s=0.5) for s in groups.values()), conductor.stop(grace_s=0.5))


def request(text: str, kw: dict, image_png: bytes | None = None):
    from mstar.v1 import conductor_pb2 as cpb

    files = [cpb.InputFile(name="image", content_type="image/png", data=image_png)] if image_png else []
    return cpb.GenerateRequest(model="bagel", text=text, model_kwargs_json=json.dumps(kw), files=files)


async def one(stub, req) -> dict:
    t0, first, tokens, image = time.perf_counter(), None, 0, b""
    async for r in stub.Generate(req, timeout=3600):
        for c in r.chunks:
            if c.name == "text":
                first = first or time.perf_counter() - t0
                tokens += len(c.token_ids)
            elif c.name == "image":
                image += c.data
        if r.HasField("final"):  # every decoded token, text or not (random weights' ids may decode to nothing)
            tokens = r.final.usage.completion_tokens
    return {"total_s": time.perf_counter() - t0, "ttft_s": first, "tokens": tokens, "image": image}


@contextlib.contextmanager
def launched(config_name: str, kwargs: dict, gpus: int):
    """The layout as ``mstar serve`` runs it: every group its own process on its rank's device
    (tensors between groups over CUDA IPC where they share a host)."""
    import tempfile

    import grpc
    import yaml

    from mstar.config import load_config
    from mstar.launcher import LaunchOptions, Mesh
    from mstar.services.links import CHANNEL_OPTIONS
    from mstar.v1 import conductor_pb2_grpc

    raw = yaml.safe_load((ROOT / "models/bagel/configs" / f"{config_name}.yaml").read_text())
    raw["model_kwargs"] = {**(raw.get("model_kwargs") or {}), **kwargs}
    path = Path(tempfile.mkdtemp(prefix="bagel-bench-")) / f"{config_name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    m = Mesh(load_config(path), LaunchOptions(path, port=0, grpc_port=0, gpus=list(range(gpus)) or None,
                                              log_level="WARNING", startup_timeout_s=900, request_timeout_s=3600))
    m.start()
    try:
        yield m, lambda: grpc.aio.insecure_channel(m.conductor_address, options=CHANNEL_OPTIONS), \
            conductor_pb2_grpc.ConductorStub
    finally:
        m.stop()


def edge_traffic(urls: dict[str, str]) -> dict[tuple[str, ...], list[float]]:
    """The node groups' tensor traffic so far, from their /metrics: (src, dst, edge, transport) ->
    [tensors, bytes]."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for name, url in urls.items():
        if name in ("gateway", "envoy", "conductor"):
            continue
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            if fam.name in ("mstar_edge_tensors", "mstar_edge_bytes"):
                for smp in fam.samples:
                    if smp.name in (fam.name, fam.name + "_total"):
                        key = tuple(smp.labels[k] for k in ("src", "dst", "edge", "transport"))
                        out.setdefault(key, [0.0, 0.0])[fam.name == "mstar_edge_bytes"] += smp.value
    return out


def traffic_between(before: dict, after: dict, steps: int) -> list[dict]:
    """What crossed between different groups during one request, per flow step."""
    rows = []
    for key, (n, b) in sorted(after.items()):
        n0, b0 = before.get(key, [0.0, 0.0])
        src, dst, edge, transport = key
        if src != dst and n > n0:
            rows.append({"src": src, "dst": dst, "edge": edge, "transport": transport, "tensors": n - n0,
                         "bytes": b - b0, "bytes_per_step": (b - b0) / steps})
    return rows


def image_difference(a: bytes, b: bytes) -> dict:
    import numpy as np
    from PIL import Image

    x, y = (np.asarray(Image.open(io.BytesIO(v)).convert("RGB"), dtype=np.int16) for v in (a, b))
    if x.shape != y.shape:
        return {"shapes": [list(x.shape), list(y.shape)]}
    d = np.abs(x - y)
    return {"max_abs": int(d.max()), "mean_abs": float(d.mean()), "frac_over_8": float((d > 8).mean())}


def served(args, kwargs: dict, png: bytes) -> dict:
    async def go():
        out = {}
        async with mesh("default", kwargs, {"bagel": args.device}) as stub:
            for size in args.sizes:
                kw = {"height": size, "width": size, "steps": args.steps, "seed": 1}
                await one(stub, request(PROMPT, kw))  # warm
                out[f"t2i_{size}"] = statistics.median([(await one(stub, request(PROMPT, kw)))["total_s"]
                                                        for _ in range(args.reps)])
            out["edit"] = (await one(stub, request("make it blue", {"mode": "edit", "steps": args.steps, "seed": 1}, png)))["total_s"]
            # time to first token as the reference's is timed: a one-token answer (ViT, prefill, one
            # decode step); throughput: max_tokens decoded by every request (ignore_eos), c at once
            first_token = {"mode": "understand", "max_tokens": 1}
            answer = {"mode": "understand", "max_tokens": args.max_tokens, "ignore_eos": True}
            await one(stub, request("describe the image", answer, png))
            for c in args.concurrency:
                res = await asyncio.gather(*(one(stub, request("describe the image", first_token, png)) for _ in range(c)))
                t0 = time.perf_counter()
                done = await asyncio.gather(*(one(stub, request("describe the image", answer, png)) for _ in range(c)))
                wall = time.perf_counter() - t0
                out[f"understand_c{c}"] = {"ttft_median_s": statistics.median(r["total_s"] for r in res),
                                           "tokens": sum(r["tokens"] for r in done), "tokens_per_s": sum(r["tokens"] for r in done) / wall}
        return out
    return asyncio.run(go())


#: layout -> (config, devices): the CFG branches on one, two, three devices (cfg_parallel*), or every
#: pass split by rows over two or three (sequence_parallel*)
LAYOUTS = {"one_gpu": ("default", 1), "two_gpus": ("cfg_parallel_2gpu", 2), "three_gpus": ("cfg_parallel", 3),
           "two_gpus_sp": ("sequence_parallel_2gpu", 2), "three_gpus_sp": ("sequence_parallel", 3)}


def multi_gpu(args, kwargs: dict, png: bytes, record: dict, save) -> None:
    """Text-to-image at the first size and editing, served by the launcher's mesh (a process per
    group) in each of ``args.layouts`` that fits the devices here; each image saved beside the
    record (``compare`` sets them against the one-device run's)."""
    import torch

    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 3
    out: dict = {"gpus": gpus}
    record["multi_gpu"] = out  # in the record from the start: save() after each layout keeps it
    size = args.sizes[0]
    jobs = {"t2i": (PROMPT, {"height": size, "width": size, "steps": args.steps, "seed": 1}, None),
            "edit": ("make it blue", {"mode": "edit", "steps": args.steps, "seed": 1}, png)}

    async def go(m, channel, stub_type) -> dict:
        res = {}
        urls = m.metrics_urls()
        async with channel() as ch:
            stub = stub_type(ch)
            for job, (text, kw, image) in jobs.items():
                await one(stub, request(text, kw, image))  # warm
                before = edge_traffic(urls)
                first = await one(stub, request(text, kw, image))
                traffic = traffic_between(before, edge_traffic(urls), args.steps)
                times = [first["total_s"]] + [(await one(stub, request(text, kw, image)))["total_s"]
                                              for _ in range(args.reps - 1)]
                res[job] = {"median_s": statistics.median(times), "times_s": times, "traffic": traffic,
                            "image": first["image"]}
        return res

    for name in args.layouts:
        config, devices = LAYOUTS[name]
        if devices > gpus:
            continue
        with launched(config, kwargs, gpus=devices if args.device.startswith("cuda") else 0) as m:
            res = asyncio.run(go(*m))
        for job, r in res.items():
            (args.out.parent / f"{name}_{job}.png").write_bytes(r.pop("image"))
        out[name] = res
        save()


def compare(records: list[Path], out: Path) -> dict:
    """The multi-GPU layouts of ``records`` (runs of ``--parts multi_gpu``, their images beside them)
    against the one-device layout's: latency ratios and image differences."""
    layouts: dict = {}
    for path in records:
        layouts |= {k: v for k, v in json.loads(path.read_text())["multi_gpu"].items() if k != "gpus"}
    base = layouts["one_gpu"]
    res = {}
    for name, jobs in layouts.items():
        res[name] = {job: {"median_s": r["median_s"], "vs_one_gpu": r["median_s"] / base[job]["median_s"],
                           "image_vs_one_gpu": image_difference((out.parent / f"one_gpu_{job}.png").read_bytes(),
                                                                (out.parent / f"{name}_{job}.png").read_bytes())}
                     for job, r in jobs.items()}
    out.write_text(json.dumps(res, indent=1))
    return res


# -- the reference -------------------------------------------------------------------------------
class _OnDevice:
    """The reference VAE with its inputs moved to its device (its callers pass host tensors)."""

    def __init__(self, vae, device: str, dtype):
        self.vae, self.device, self.dtype = vae, device, dtype

    def encode(self, x):
        return self.vae.encode(x.to(self.device, self.dtype))

    def decode(self, z):
        return self.vae.decode(z.to(self.device, self.dtype))


def reference(args, ckpt: Path, png_image, out: dict, save) -> None:
    """The public inferencer on the same checkpoint (bf16 on CUDA as its app runs it), its figures
    into ``out`` (saved after each: a part that fails keeps the ones before it)."""
    import importlib.util

    import torch

    sys.path.insert(0, str(args.reference))
    notes = []
    missing = [m for m in ("flash_attn", "torchvision", "cv2") if importlib.util.find_spec(m) is None]
    sys.path.insert(0, str(ROOT / "tests/bagel/data"))
    from make_reference import install_stand_ins, reference_model

    if missing:
        install_stand_ins(only_missing=True)
        notes.append(f"stand-ins (tests/bagel/data/make_reference.py) for {', '.join(missing)}: flash_attn's "
                     "varlen attention as torch SDPA, torchvision's resize with PIL, cv2 empty")
    from data.transforms import ImageTransform
    from inferencer import InterleaveInferencer

    from mstar.models.bagel.config import config_from_dir

    v = config_from_dir(ckpt).vae
    dev, dtype = args.device, torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model, vae, tokenizer, ids = reference_model(ckpt, v.ch, v.ch_mult, v.num_res_blocks, device=dev, dtype=dtype)
    model, vae = model.to(dtype), vae.to(dtype)
    if dev.startswith("cuda"):
        # as the reference's app loads it (accelerate dispatch with its device map and forced hooks):
        # the hooks move each module's inputs to its weights' device (the inferencer builds its index
        # tensors on the host)
        from accelerate import dispatch_model, infer_auto_device_map

        device_map = infer_auto_device_map(model, max_memory={0: "130GiB"},
                                           no_split_module_classes=["Bagel", "Qwen2MoTDecoderLayer"])
        model = dispatch_model(model, device_map=device_map, force_hooks=True)
        vae = _OnDevice(vae, dev, dtype)
        notes.append("the reference's app keeps the VAE on the CPU; here it runs on the GPU in bf16, as ours does")
    # random weights draw ids past the tokenizer's last (the head has 152064 rows, the tokenizer
    # fewer): its decode would fail on them; they decode to nothing, as ours detokenizes them
    known, decode = len(tokenizer), tokenizer.decode
    tokenizer.decode = lambda ids, *a, **k: decode(ids[ids < known] if isinstance(ids, torch.Tensor) else
                                                   [i for i in ids if i < known], *a, **k)
    notes.append("the reference tokenizer's decode drops ids past its vocabulary (random weights sample them)")
    inf = InterleaveInferencer(model, vae, tokenizer, ImageTransform(*args.vae_image, 16), ImageTransform(*args.vit_image, 14), ids)
    out["notes"] = notes
    t2i = dict(cfg_text_scale=4.0, cfg_img_scale=1.0, cfg_interval=[0.4, 1.0], timestep_shift=3.0,
               num_timesteps=args.steps, cfg_renorm_type="global")
    for size in args.sizes:
        out[f"t2i_{size}"] = timed(lambda s=size: inf(text=PROMPT, image_shapes=(s, s), **t2i), dev, args.reps, args.warmup)
        save()
    out["edit"] = timed(lambda: inf(image=png_image, text="make it blue", cfg_text_scale=4.0, cfg_img_scale=2.0,
                                    cfg_interval=[0.0, 1.0], timestep_shift=3.0, num_timesteps=args.steps,
                                    cfg_renorm_type="text_channel"), dev, args.reps, args.warmup)
    save()
    und = dict(understanding_output=True, do_sample=False)
    out["understand_ttft"] = timed(lambda: inf(image=png_image, text="describe the image", max_think_token_n=2, **und),
                                   dev, args.reps, args.warmup)
    save()
    decode_text = model.generate_text  # as ignore_eos: no end token, so every answer is max_tokens long
    model.generate_text = lambda *a, **k: decode_text(*a, **{**k, "end_token_id": -1})
    one_answer = timed(lambda: inf(image=png_image, text="describe the image", max_think_token_n=args.max_tokens + 1, **und),
                       dev, args.reps, args.warmup)
    model.generate_text = decode_text
    out["understand_tokens_per_s"] = args.max_tokens / one_answer["median_s"]  # one request at a time, any concurrency
    del model, vae


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny random checkpoint (smoke test)")
    ap.add_argument("--ckpt", type=Path, help="checkpoint directory (full-size random weights written there if absent)")
    ap.add_argument("--reference", type=Path, help="an extracted github.com/ByteDance-Seed/Bagel tree: the baseline")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 512])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--parts", nargs="+", choices=["pipeline", "served", "reference", "multi_gpu", "compare"],
                    default=["pipeline", "served", "reference"],
                    help="multi_gpu: --layouts through the mesh; compare: the --records' layouts against one_gpu")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--model-kwargs", type=json.loads, default={}, help="JSON: more placement model_kwargs (served parts)")
    ap.add_argument("--records", type=Path, nargs="+", default=[], help="compare: multi_gpu records (images beside them)")
    args = ap.parse_args()
    if args.parts == ["compare"]:
        print(json.dumps(compare(args.records, args.out), indent=1))
        return

    import torch

    from mstar.models.bagel.demo import write_checkpoint, write_full_checkpoint
    from mstar.models.bagel.flow import FlowParams
    from mstar.models.bagel.media import Fit
    from mstar.models.bagel.pipeline import BagelPipeline

    if args.tiny:
        args.sizes, args.steps, args.concurrency, args.max_tokens = [64, 32], 4, [1, 2], 4
        args.reps, args.warmup = 1, 0
        args.vae_image, args.vit_image = (96, 48), (70, 42)
    else:
        args.vae_image, args.vit_image = (1024, 512), (980, 224)
    ckpt = args.ckpt or Path("/tmp/bagel-bench-tiny" if args.tiny else "/tmp/bagel-bench-full")
    if not (ckpt / "ema.safetensors").exists():
        write_checkpoint(ckpt) if args.tiny else write_full_checkpoint(ckpt, device=args.device)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    image = test_image(args.sizes[0], args.sizes[0] * 3 // 4 // 16 * 16)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    png = buf.getvalue()
    record: dict = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor(),
                    "gpus": torch.cuda.device_count() if args.device.startswith("cuda") else 0,
                    "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}

    def save() -> None:  # after every part: a run cut short keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))

    kwargs = {"checkpoint": str(ckpt), "vae_image": list(args.vae_image), "vit_image": list(args.vit_image),
              **args.model_kwargs}
    if "pipeline" in args.parts:
        pipe = BagelPipeline(ckpt, args.device, dtype, Fit(*args.vae_image, 16), Fit(*args.vit_image, 14))
        ours: dict = {}
        record["ours_pipeline"] = ours
        for size in args.sizes:
            p = FlowParams(size, size, args.steps)
            ours[f"t2i_{size}"] = timed(lambda p=p: pipe.run("text_to_image", PROMPT, params=p, seed=1), args.device,
                                        args.reps, args.warmup)
            save()
        ours["edit"] = timed(lambda: pipe.run("edit", "make it blue", image, params=FlowParams(
            0, 0, args.steps, cfg_img=2.0, interval=(0.0, 1.0), renorm="text_channel"), seed=1), args.device,
            args.reps, args.warmup)
        peak = bf16_peak_tflops(args.device)
        record["flops"] = {"bf16_peak_tflops": peak, **flop_floor(pipe, args.sizes[0], args.steps, peak)}
        save()
        pipe = None  # frees its weights before the served and reference runs load theirs
    if "served" in args.parts:
        record["ours_served"] = served(args, kwargs, png)
        save()
    if "multi_gpu" in args.parts:
        multi_gpu(args, kwargs, png, record, save)
        save()
    if "reference" in args.parts and args.reference:
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
        record["reference"] = {}
        reference(args, ckpt, image, record["reference"], save)
        save()
    print(json.dumps(record, indent=1))

if __name__ == "__main__":
    main()
