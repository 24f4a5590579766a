"""One decode pass of the Qwen3-Omni Thinker and Talker engines (``decode_graphs.py``), CUDA graphs
against eager, per batch size: the pass alone (one new token per sequence over the slot cache;
no sampling, no code predictor), full-size architecture with random bf16 weights made on load
(``bench_omni.py``'s checkpoint).

Every row has ``--context`` cached tokens (the cache holds zeros: the work is that of real K/V)
and attends its span bucket's keys, as served with ``--max-seq-len``. Each engine's graphs are
captured in the warm-up runs; a pass's time is its wall time with the device synchronized, the
median of ``--iters``. Memory: ~67 GB of weights for both parts; one H200, or ``--parts thinker``
and ``--parts talker`` in two runs on an H100.

    python bench/qwen3_omni/decode_step.py --device cuda --out bench/results/qwen3_omni/decode_step.json
    python bench/qwen3_omni/decode_step.py --device cpu --tiny --out /tmp/decode-step.json   # checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_omni import write_checkpoint

from mstar.models.qwen3_omni.direct import load_parts
from mstar.models.qwen3_omni.talker_engine import TalkerEngine
from mstar.models.qwen3_omni.thinker_engine import ThinkerEngine


def engine(p, part: str, batch: int, max_len: int, graphs: bool):
    if part == "thinker":
        return ThinkerEngine(p.thinker, p.cfg.accept_hidden_layer, batch, max_len, cuda_graphs=graphs)
    return TalkerEngine(p.talker, p.specials(), batch, max_len, cuda_graphs=graphs)


def model_inputs(p, part: str, batch: int, device: str) -> dict[str, torch.Tensor]:
    if part == "thinker":
        return {"ids": torch.randint(0, p.cfg.text.vocab_size, (batch,))}
    return {"embeds": torch.randn(batch, p.cfg.talker.hidden_size, device=device, dtype=p.dtype)}


@torch.inference_mode()
def time_pass(eng, inputs: dict[str, torch.Tensor], context: int, warmup: int, iters: int) -> float:
    """Median ms of one decode pass of ``len(batch)`` rows at ``context`` cached tokens."""
    b = next(iter(inputs.values())).shape[0]
    slots, lengths = list(range(b)), [context] * b
    positions = torch.full((3, b), float(context))
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        eng.decode.run(slots, lengths, positions, **inputs)
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        eng.decode.run(slots, lengths, positions, **inputs)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny random model (CPU smoke run: measures nothing)")
    ap.add_argument("--root", help="folder for the checkpoint (a temporary one otherwise)")
    ap.add_argument("--parts", nargs="+", choices=["thinker", "talker"], default=["thinker", "talker"])
    ap.add_argument("--batch", default="1,4,16,32")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    ap.add_argument("--max-seq-len", type=int, default=2048, help="the engines' (the span is capped there)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    ckpt = write_checkpoint(Path(args.root or tempfile.mkdtemp(prefix="omni-decode-")), args.tiny)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    p = load_parts(ckpt, args.device, dtype, tuple(args.parts))
    result: dict = {"device": args.device, "tiny": args.tiny, "context": args.context,
                    "max_seq_len": args.max_seq_len, "rows": []}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    for part in args.parts:
        for b in [int(x) for x in args.batch.split(",")]:
            row: dict = {"part": part, "batch": b}
            for graphs in (False, True):
                eng = engine(p, part, b, args.max_seq_len, graphs)
                row["graph_ms" if graphs else "eager_ms"] = time_pass(eng, model_inputs(p, part, b, args.device),
                                                                      args.context, args.warmup, args.iters)
                if graphs:
                    row["graph_replays"] = sum(loop.stats.graph_replays for loop in eng.decode.loops.values())
                    row["span"] = eng.decode.span(args.context)
                del eng  # its cache and graphs (the engine and its decode graphs refer to each other)
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            result["rows"].append(row)
            print(f"{part:8s} batch {b:3d}: eager {row['eager_ms']:8.2f} ms  graphs {row['graph_ms']:8.2f} ms  "
                  f"({row['eager_ms'] / row['graph_ms']:.1f}x; {row['graph_replays']} replays)", flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
