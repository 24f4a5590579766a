"""One decode pass of the Qwen3-Omni Thinker and Talker engines (``decode_graphs.py``), CUDA graphs
against eager, per batch size: the pass alone (one new token per sequence over the slot cache;
no sampling, no code predictor), full-size architecture with random bf16 weights made on load
(``bench_omni.py``'s checkpoint).

Every row has ``--context`` cached tokens (the cache holds zeros: the work is that of real K/V)
and attends its span bucket's keys, as served with ``--max-seq-len``. Each engine's graphs are
captured in the warm-up runs; a pass's time is its wall time with the device synchronized, the
median of ``--iters``. Memory: ~67 GB of weights for both parts; one H200, or ``--parts thinker``
and ``--parts talker`` in two runs on an H100. ``--tp N``: after TP=1, the Thinker's pass at
TP=N in N spawned ranks (GPUs 0..N-1), timed on rank 0 as the engine runs it under TP (its host
inputs sent to every rank), each batch against TP=1's graphs (issue 32: <= 0.65x at 16 rows).
``--compiled``: also the graph pass with the decoder layers under torch.compile (``compile_layers``,
as served on a GPU), at TP=1 and TP=N.

    python bench/qwen3_omni/decode_step.py --device cuda --out bench/results/qwen3_omni/decode_step.json
    python bench/qwen3_omni/decode_step.py --device cuda --parts thinker --batch 1,16 --tp 2 --out F   # two GPUs
    python bench/qwen3_omni/decode_step.py --device cpu --tiny --out /tmp/decode-step.json   # checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_omni import write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
from gpu_timing import profile_parts  # noqa: E402  (the engine benchmarks' timing helpers)

from mstar.models.qwen3_omni.direct import load_parts
from mstar.models.qwen3_omni.layers import compile_layers
from mstar.models.qwen3_omni.talker_engine import TalkerEngine
from mstar.models.qwen3_omni.thinker_engine import ThinkerEngine


def engine(p, part: str, batch: int, max_len: int, graphs: bool):
    if part == "thinker":
        return ThinkerEngine(p.thinker, p.cfg.accept_hidden_layer, batch, max_len, cuda_graphs=graphs)
    return TalkerEngine(p.talker, p.specials(), batch, max_len, cuda_graphs=graphs)


def decoder(p, part: str):
    return p.thinker.model if part == "thinker" else p.talker.model


def modes(args) -> tuple:
    return MODES if args.compiled else MODES[:2]


def model_inputs(p, part: str, batch: int, device: str) -> dict[str, torch.Tensor]:
    if part == "thinker":
        return {"ids": torch.randint(0, p.cfg.text.vocab_size, (batch,))}
    return {"embeds": torch.randn(batch, p.cfg.talker.hidden_size, device=device, dtype=p.dtype)}


@torch.inference_mode()
def time_calls(run, cuda: bool, warmup: int, iters: int) -> float:
    """Median ms of ``run()``, the device synchronized around each."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def one_pass(eng, inputs: dict[str, torch.Tensor], context: int):
    """One decode pass of ``len(batch)`` rows at ``context`` cached tokens, as a function."""
    b = next(iter(inputs.values())).shape[0]
    slots, lengths = list(range(b)), [context] * b
    positions = torch.full((3, b), float(context))
    return lambda: eng.decode.run(slots, lengths, positions, **inputs)


def time_pass(eng, inputs: dict[str, torch.Tensor], context: int, warmup: int, iters: int) -> float:
    """Median ms of one decode pass."""
    return time_calls(one_pass(eng, inputs, context), eng.device.type == "cuda", warmup, iters)


#: the passes timed per batch: (row key, CUDA graphs, the layers torch.compile'd: compile_layers)
MODES = (("eager_ms", False, False), ("graph_ms", True, False), ("compiled_graph_ms", True, True))


def _tp_rank(rank: int, size: int, init: str, ckpt: str, device: str, batches: list[int], context: int, max_len: int,
             warmup: int, iters: int, out: str, modes: tuple) -> None:
    """One rank of the Thinker at TP=``size`` (cuda:rank, or the CPU over gloo): rank 0 times the
    engine's decode pass as served (``_mirrored``: the host inputs go to every rank, each runs its
    shard, its collectives); the others follow."""
    from mstar.services.engines.tensor_parallel import TensorParallel, TPSpec

    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    tp = TensorParallel(TPSpec(rank, size, init), dev)
    p = load_parts(ckpt, dev, torch.bfloat16 if device == "cuda" else torch.float32, ("thinker",), tp=tp)
    rows = []
    for b in batches:
        row: dict = {"batch": b}
        for key, graphs, compiled in modes:
            compile_layers(p.thinker.model, "inductor" if compiled else None)
            eng = ThinkerEngine(p.thinker, p.cfg.accept_hidden_layer, b, max_len, tp=tp, cuda_graphs=graphs)
            if rank == 0:
                pass_args = (torch.randint(0, p.cfg.text.vocab_size, (b,)), torch.full((3, b), float(context)),
                             list(range(b)), [context] * b)  # ids, positions, slots, lengths
                row[key] = time_calls(
                    lambda eng=eng, a=pass_args: eng._mirrored("_decode_pass", *a), device == "cuda", warmup, iters)
                eng.close()  # the followers' follow() returns
            else:
                eng.follow()
            del eng
            gc.collect()
        rows.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    torch.distributed.barrier()
    tp.close()


def thinker_tp(ckpt: Path, args, batches: list[int]) -> list[dict]:
    """The Thinker's decode pass at TP=``args.tp`` in spawned ranks: rows of eager_ms / graph_ms."""
    import multiprocessing as mp

    from mstar.services.engines.tensor_parallel import Rendezvous

    init = Rendezvous().init_method  # removed at exit
    out = Path(tempfile.mkdtemp(prefix="omni-tp-")) / "rows.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_tp_rank, args=(r, args.tp, init, str(ckpt), args.device, batches, args.context,
                                                 args.max_seq_len, args.warmup, args.iters, str(out), modes(args)))
             for r in range(args.tp)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(args.tp_timeout)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    codes = [proc.exitcode for proc in procs]
    if codes != [0] * args.tp:
        raise SystemExit(f"TP={args.tp} ranks ended with exit codes {codes}")
    return json.loads(out.read_text())


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
    ap.add_argument("--tp", type=int, default=1, help="also the Thinker at this tensor-parallel size (GPUs 0..tp-1; "
                                                        "gloo ranks on a CPU), in spawned ranks after TP=1")
    ap.add_argument("--tp-timeout", type=float, default=900, help="seconds the TP ranks may take")
    ap.add_argument("--profile", metavar="DIR", help="also each TP=1 graph pass's kernel table (torch.profiler)")
    ap.add_argument("--compiled", action="store_true", help="also the graph pass with the decoder layers "
                    "torch.compile'd around their GEMMs and attention (compile_layers; CUDA)")
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
            for key, graphs, compiled in modes(args):
                compile_layers(decoder(p, part), "inductor" if compiled else None)
                eng = engine(p, part, b, args.max_seq_len, graphs)
                inputs = model_inputs(p, part, b, args.device)
                row[key] = time_pass(eng, inputs, args.context, args.warmup, args.iters)
                if graphs and args.profile:
                    with torch.inference_mode():
                        name = f"{part}_b{b}" + ("_compiled" if compiled else "")
                        profile_parts(args.profile, {name: one_pass(eng, inputs, args.context)}, args.device)
                if graphs:
                    row["graph_replays"] = sum(loop.stats.graph_replays for loop in eng.decode.loops.values())
                    row["span"] = eng.decode.span(args.context)
                del eng  # its cache and graphs (the engine and its decode graphs refer to each other)
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            compile_layers(decoder(p, part), None)
            result["rows"].append(row)
            print(f"{part:8s} batch {b:3d}: " + "  ".join(f"{k[:-3]} {row[k]:8.2f} ms" for k, _, _ in modes(args))
                  + f"  ({row['graph_replays']} replays)", flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
    if args.tp > 1 and "thinker" in args.parts:
        del p  # TP=1's weights leave the first GPU before the ranks load theirs
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        batches = [int(x) for x in args.batch.split(",")]
        result[f"thinker_tp{args.tp}"] = tp_rows = thinker_tp(ckpt, args, batches)
        for r in tp_rows:
            one = next(x for x in result["rows"] if x["part"] == "thinker" and x["batch"] == r["batch"])
            for k, graphs, _ in modes(args):
                if graphs:
                    r[k.replace("_ms", "_vs_tp1")] = r[k] / one[k]
            print(f"thinker  batch {r['batch']:3d} at TP={args.tp}: " + "  ".join(
                f"{k[:-3]} {r[k]:8.2f} ms" + (f" ({r[k.replace('_ms', '_vs_tp1')]:.2f}x TP=1's)" if g else "")
                for k, g, _ in modes(args)),
                flush=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
