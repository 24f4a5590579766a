"""SNAC 24 kHz window decodes on the GPU, as the SNAC node runs them: ms per CUDA-graph replay of
a batch of packed windows (StatelessEngine, the node's batch buckets), per variant, window length
and batch; plus an eager decode's kernel count.

    python bench/orpheus/snac_bench.py --root CKPT_ROOT --out $OUT/snac_bench.json \
        [--variants graph,compile] [--codes 21,35] [--batches 1,2,4,8,16,32] [--dtype bfloat16]

Variants: ``graph`` = the module decoder replayed in a CUDA graph (``snac_kernels: torch``);
``triton`` = the fused channels-last decode (``snac_triton.py``, ``snac_kernels: triton``),
graphed (``triton@N``: time tiles of N); ``compile`` = the module decoder under ``torch.compile`` (inductor, static shapes),
graphed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mstar.models.orpheus.snac import load_snac_decoder
from mstar.models.orpheus.snac_triton import SnacTritonDecoder
from mstar.models.orpheus.tokens import TOKENS_PER_FRAME
from mstar.services.engines.stateless import StatelessEngine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def replay_ms(engine: StatelessEngine, codes: int, batch: int, n: int = 50) -> float:
    """Mean ms of engine.run on ``batch`` packed windows of ``codes`` codes (host -> GPU copy,
    replay, output clone), synchronised at the end, as the node runs it."""
    items = [torch.randint(0, 4096, (codes,), dtype=torch.int64) for _ in range(batch)]
    for _ in range(3):
        engine.run(items)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        engine.run(items)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def kernel_rows(fn, x: torch.Tensor) -> list[dict]:
    """The CUDA kernels of one eager call, by total time: name, count, total us."""
    from torch.profiler import ProfilerActivity, profile

    fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    sums: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            s = sums.setdefault(e.name[:120], [0, 0.0])
            s[0] += 1
            s[1] += e.device_time
    rows = sorted(sums.items(), key=lambda kv: -kv[1][1])
    return [{"kernel": k, "count": c, "total_us": round(t, 1)} for k, (c, t) in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="graph,triton")
    ap.add_argument("--codes", default="21,35")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--profile-batch", type=int, default=0, help="also list each variant's top kernels at this batch")
    args = ap.parse_args()
    path = Path(args.root) / "hubertsiuzdak" / "snac_24khz"
    dec = load_snac_decoder(path, device="cuda", dtype=DTYPES[args.dtype])
    batches = [int(b) for b in args.batches.split(",")]
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
                 "ms_per_replay": {}, "compile_s": {}, "eager_kernels": {}}

    def decode_packed(packed: torch.Tensor) -> torch.Tensor:
        f = packed.shape[1] // TOKENS_PER_FRAME
        return dec.decode(list(packed.split([f, 2 * f, 4 * f], dim=1)), checked=True)

    for variant in args.variants.split(","):
        compiled = variant == "compile"
        if compiled:  # one compile per (batch, window) shape: keep them all
            for knob in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, 64)
        fn = decode_packed
        if variant.startswith("triton"):  # "triton@64": time tiles of 64
            fused = SnacTritonDecoder(dec, block_t=int(variant.partition("@")[2] or 0) or None)

            def fn(packed: torch.Tensor, fused=fused) -> torch.Tensor:
                f = packed.shape[1] // TOKENS_PER_FRAME
                return fused.decode(list(packed.split([f, 2 * f, 4 * f], dim=1)))
        engine = StatelessEngine(fn, batches, compile=compiled, cuda_graphs=True, device="cuda")
        for codes in (int(c) for c in args.codes.split(",")):
            t = time.perf_counter()
            for b in batches:  # capture (and compile) every bucket first
                engine.run([torch.zeros(codes, dtype=torch.int64)] * b)
            torch.cuda.synchronize()
            res["compile_s"][f"{variant}_{codes}"] = time.perf_counter() - t
            for b in batches:
                ms = replay_ms(engine, codes, b)
                res["ms_per_replay"][f"{variant}_{codes}_b{b}"] = ms
                print(variant, codes, b, f"{ms:.3f} ms", flush=True)
            if variant == "graph" or variant.startswith("triton"):
                x = torch.randint(0, 4096, (1, codes), device="cuda")
                with torch.inference_mode():
                    res["eager_kernels"][f"{variant}_{codes}"] = sum(r["count"] for r in kernel_rows(fn, x))
                    if args.profile_batch:
                        xb = torch.randint(0, 4096, (args.profile_batch, codes), device="cuda")
                        table = kernel_rows(fn, xb)[:20]
                        res.setdefault("kernels", {})[f"{variant}_{codes}_b{args.profile_batch}"] = table
                        for row in table:
                            print(variant, codes, row, flush=True)
    print(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
