"""Tensor parallelism on two GPUs: the KV-cache engine with its model split over two ranks
(TP=2, NCCL, CUDA graphs with the all-reduces captured) against the same engine on one GPU
(TP=1), same checkpoint, same run.

Parity: a direct prefill pass's logits (relative error, bf16) and greedy tokens through the
scheduled path (CUDA graphs, pipelined decode). Speed: decode tokens/s at each batch size
(prompt 64, 256 new tokens, sampling), timed around ``engine.step`` as decode_bench.py does.

    python bench/engines/tp_bench.py --ckpt DIR --out tp_bench.json   # DIR: a HF Llama checkpoint
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mstar.services.engines.tensor_parallel import Rendezvous

PROMPTS = {f"g{i}": list(range(100 + 7 * i, 140 + 9 * i)) for i in range(4)}
PARITY_PROMPT = list(range(1000, 1077))
PROMPT_LEN, NEW_TOKENS = 64, 256


def rank_main(rank: int, world: int, ckpt: str, init: str, out: str, batches: list[int]) -> None:
    from mstar.services.engines import (
        EngineConfig,
        ForwardItem,
        KVCacheEngine,
        LlamaForCausalLM,
        SamplingParams,
    )
    from mstar.services.engines.tensor_parallel import TensorParallel, TPSpec

    dev = f"cuda:{rank}"
    torch.cuda.set_device(dev)
    tp = TensorParallel(TPSpec(rank, world, init), dev) if world > 1 else None
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device=dev, tp=tp)
    cfg = EngineConfig(page_size=16, gpu_memory_fraction=0.7, max_num_seqs=max(batches), attention="flashinfer")
    eng = KVCacheEngine(model, cfg, tp=tp)
    if rank > 0:
        eng.follow()
        os._exit(0)
    with torch.inference_mode():
        hidden = eng.forward([ForwardItem("parity", token_ids=torch.tensor(PARITY_PROMPT))])[0]
        logits = eng.logits(hidden).float().cpu()
    eng.release("parity")
    tokens = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    res = {"logits": logits, "tokens": tokens, "graph_steps": eng.stats.graph_steps,
           "pipelined_steps": eng.stats.pipelined_steps, "speed": {}}
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        res["speed"][b] = decode_speed(eng, b, gen)
        print(f"tp={world} batch {b}: {res['speed'][b]}", flush=True)
    torch.save(res, out)
    eng.close()
    os._exit(0)  # no process-group teardown: NCCL's destroy can wait on the other rank forever


@torch.inference_mode()
def decode_speed(eng, batch: int, gen: torch.Generator) -> dict:
    from mstar.services.engines import SamplingParams

    ids = torch.randint(0, eng.model.config.vocab_size, (batch, PROMPT_LEN), generator=gen).tolist()
    eng.generate({f"warm{i}": ids[i] for i in range(batch)}, SamplingParams(temperature=1.0, max_tokens=8))
    for i in range(batch):
        eng.add_request(f"r{i}", ids[i], SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS))
    steps = []
    torch.cuda.synchronize()
    while eng.has_work:
        t0 = time.perf_counter()
        events = eng.step()
        steps.append(time.perf_counter() - t0)
        for e in events:
            if e.status.finished:
                eng.release(e.request_id)
    decode = steps[1:]
    return {"decode_step_ms_median": statistics.median(decode) * 1e3, "decode_tok_s": batch * len(decode) / sum(decode)}


def run(world: int, ckpt: str, out: Path, batches: list[int], timeout_s: float = 900) -> dict:
    init = Rendezvous().init_method  # removed at exit
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, ckpt, init, str(out), batches)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    if codes != [0] * world:
        raise RuntimeError(f"tp={world} ranks exited with {codes}")
    return torch.load(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,16,64,128")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="tp-bench-")) / "x"  # logits files: not next to the report
    one = run(1, args.ckpt, tmp.with_name("tp1.pt"), batches)
    two = run(2, args.ckpt, tmp.with_name("tp2.pt"), batches)
    a, b = one["logits"], two["logits"]
    agree = sum(x == y for k in PROMPTS for x, y in zip(one["tokens"][k], two["tokens"][k], strict=True))
    report = {
        "command": "python bench/engines/tp_bench.py --ckpt CKPT --out OUT --batches " + args.batches,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "checkpoint": json.loads((Path(args.ckpt) / "config.json").read_text()).get("architectures"),
        "parity": {"prefill_logits_rel_err": float((a - b).norm() / a.norm()),
                   "prefill_logits_max_abs": float((a - b).abs().max()),
                   "greedy_tokens_agree": f"{agree}/{sum(len(v) for v in one['tokens'].values())}",
                   "tp2_graph_steps": two["graph_steps"], "tp2_pipelined_steps": two["pipelined_steps"]},
        "speed": [{"batch": bt, "tp1": one["speed"][bt], "tp2": two["speed"][bt],
                   "tp2_over_tp1": two["speed"][bt]["decode_tok_s"] / one["speed"][bt]["decode_tok_s"]}
                  for bt in batches],
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
