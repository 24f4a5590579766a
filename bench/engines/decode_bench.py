"""Decode and prefill speed of the KV-cache engine on a Llama-3.2-3B-shaped model (GPU).

Random bf16 weights (speed does not depend on their values), shared with a transformers
LlamaForCausalLM baseline (``generate`` with ``cache_implementation="static"``). Reports per
batch size: our median decode step, decode tok/s, transformers' tok/s, and the roofline floor
(weights + KV bytes read per step / HBM copy bandwidth measured in this run). Plus prefill
tok/s, KV bytes per token, and how many 4k-token sequences fit in 60 GiB of KV.

    python bench/engines/decode_bench.py --out decode_bench.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import statistics
import time

import torch

from mstar.services.engines import (
    EngineConfig,
    ForwardItem,
    KVCacheEngine,
    LlamaConfig,
    LlamaForCausalLM,
    SamplingParams,
)
from mstar.services.engines.batch import SeqSlice, build_step_inputs
from mstar.services.engines.layers import set_weight_layout
from mstar.services.engines.weights import load_state_dict

GIB = 1024**3
SHAPE = dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
             num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
             rms_norm_eps=1e-5, max_position_embeddings=131072,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(dev: str, nbytes: int = 2 * GIB, reps: int = 30, stats: dict | None = None) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy: the best of ``reps``
    after 10 warm-up copies (CUDA events on a GPU). The best, not the median: the roofline's
    bandwidth is what the device can reach, and a median taken while its clocks settle ran 3.5%
    low in one call (bench/results/engines/2026-11-25d/), which flatters every step ÷ floor.
    ``stats`` receives the median and the worst as well."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 10):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            took = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            took = time.perf_counter() - t0
        if i >= 10:
            times.append(took)
    del src, dst
    if stats is not None:
        stats.update(median_GBps=2 * nbytes / statistics.median(times) / 1e9, worst_GBps=2 * nbytes / max(times) / 1e9)
    return 2 * nbytes / min(times)


def build_models(shape: dict, dev: str):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFLlama

    hf_cfg = HFConfig(**shape)
    with torch.device(dev):
        hf = HFLlama._from_config(hf_cfg, dtype=torch.bfloat16).eval()
    with torch.device("meta"):
        ours = LlamaForCausalLM(LlamaConfig.from_hf(hf_cfg.to_dict()))
    ours = ours.to_empty(device=dev).to(torch.bfloat16)
    ours.lm_head.weight = ours.model.embed_tokens.weight
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied to the embeddings
    load_state_dict(ours, state, source="transformers model")  # q/k/v and gate/up fused as they load
    set_weight_layout(ours, column_major=dev == "cuda")  # as from_pretrained does on CUDA
    if dev == "cuda":
        ours.fold_norms()  # as from_pretrained does on CUDA
    return hf, ours.requires_grad_(False).eval()


@torch.inference_mode()
def sanity(hf, eng: KVCacheEngine, gen: torch.Generator) -> dict:
    """Our prefill logits vs transformers' on one 64-token prompt, both bf16 (top-1 agreement, max
    diff), and each vs transformers in fp32 on the same weights (relative error, top-1 agreement):
    with random weights the top logits nearly tie, so bf16 rounding alone flips some top-1s."""
    ids = torch.randint(0, hf.config.vocab_size, (64,), generator=gen)
    (h,) = eng.forward([ForwardItem("sanity", token_ids=ids)])
    eng.release("sanity")
    ours = eng.logits(h).float()
    want = hf(ids[None].to(h.device)).logits[0].float()
    out = {"top1_agreement": (ours.argmax(-1) == want.argmax(-1)).float().mean().item(),
           "max_abs_logit_diff": (ours - want).abs().max().item(), "logit_std": want.std().item()}
    hf32 = copy.deepcopy(hf).float()
    ref = hf32(ids[None].to(h.device)).logits[0].float()
    del hf32
    for name, x in (("ours_bf16", ours), ("transformers_bf16", want)):
        out[f"{name}_vs_fp32"] = {"rel_err": ((x - ref).norm() / ref.norm()).item(),
                                  "top1_agreement": (x.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    return out


def graph_consistency(ours, eng: KVCacheEngine, gen: torch.Generator) -> dict:
    """Greedy tokens with CUDA graphs + overlap vs eager engines on the same weights: one with
    the same kernels, one with the torch reference kernels (bf16 rounding differs: a near-tie
    may flip, and the rest of that sequence with it)."""
    ids = {f"c{i}": torch.randint(0, ours.config.vocab_size, (20 + 7 * i,), generator=gen).tolist() for i in range(4)}
    greedy = SamplingParams(temperature=0, max_tokens=32)
    a = eng.generate(ids, greedy)
    out = {"tokens": 4 * 32}
    for kernels in (eng.ops.name, "torch"):
        eager = KVCacheEngine(ours, EngineConfig(page_size=16, kv_cache_bytes=GIB // 2, cuda_graphs=False,
                                                 attention=eng.runner.backend.name, overlap=False, kernels=kernels))
        b = eager.generate(ids, greedy)
        out[f"equal_vs_eager_{kernels}"] = sum(x == y for k in ids for x, y in zip(a[k], b[k], strict=True))
        out[f"first_tokens_equal_vs_eager_{kernels}"] = all(a[k][0] == b[k][0] for k in ids)
        del eager
    return out


def run_ours(eng: KVCacheEngine, batch: int, prompt: int, new: int, gen: torch.Generator) -> dict:
    params = SamplingParams(temperature=1.0, max_tokens=new, seed=None)
    ids = torch.randint(0, eng.model.config.vocab_size, (batch, prompt), generator=gen).tolist()
    eng.generate({f"warm{i}": ids[i] for i in range(batch)}, SamplingParams(temperature=1.0, max_tokens=8))
    for i in range(batch):
        eng.add_request(f"r{i}", ids[i], params)
    steps = []
    sync()
    t_start = time.perf_counter()
    while eng.has_work:
        t0 = time.perf_counter()
        events = eng.step()  # each step reads its sampled tokens back: wall time is GPU time + host gaps
        steps.append(time.perf_counter() - t0)
        for e in events:
            if e.status.finished:
                eng.release(e.request_id)
    total = time.perf_counter() - t_start
    decode = steps[1:]
    return {"prefill_step_ms": steps[0] * 1e3, "decode_step_ms_median": statistics.median(decode) * 1e3,
            "decode_tok_s": batch * len(decode) / sum(decode), "e2e_tok_s": batch * new / total,
            "steps": len(steps)}


def run_hf(hf, batch: int, prompt: int, new: int, gen: torch.Generator, repeats: int = 1) -> dict:
    """transformers' static-cache ``generate``: one warm-up call, then ``repeats`` timed ones; the
    median call's time is the one reported (``totals_s`` lists them all)."""
    ids = torch.randint(0, hf.config.vocab_size, (batch, prompt), generator=gen).to(hf.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new, min_new_tokens=new,
              cache_implementation="static", pad_token_id=0)
    t0 = time.perf_counter()
    hf.generate(ids, **kw)  # warm-up: transformers compiles the static-cache forward here
    sync()
    warm = time.perf_counter() - t0
    totals = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        sync()
        totals.append(time.perf_counter() - t0)
        assert out.shape[1] == prompt + new
    total = statistics.median(totals)
    return {"warmup_s": warm, "total_s": total, "totals_s": totals, "step_ms": total / new * 1e3,
            "tok_s": batch * new / total}


@torch.inference_mode()
def device_breakdown(eng: KVCacheEngine, batch: int, ctx: int, gen: torch.Generator, reps: int = 20) -> dict:
    """Time of one decode step's parts at ``ctx`` cached tokens (CUDA events): the model forward
    (device time of the graph replay when graphs are on; ``run_with_plan_ms`` adds the host's
    attention plan before it, the device idling meanwhile) and the LM head + sampler (eager, so
    launch gaps included)."""
    vocab = eng.model.config.vocab_size
    rids = [f"bd{i}" for i in range(batch)]
    eng.forward([ForwardItem(r, token_ids=torch.randint(0, vocab, (ctx,), generator=gen)) for r in rids])
    slices = [SeqSlice(r, "main", ctx, 1) for r in rids]
    for r in rids:
        eng.cache.reserve(r, "main", ctx + 1)
    graphs = eng.runner.graphs
    inputs = graphs.prepare(slices) if graphs is not None else build_step_inputs(eng.cache, slices)
    ids = torch.zeros(batch, dtype=torch.long, device=eng.device)
    params = [SamplingParams(temperature=1.0)] * batch

    def timed(fn) -> float:
        times = []
        for i in range(reps + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            if i >= 3:
                times.append(a.elapsed_time(b))
        return statistics.median(times)

    hidden = eng.runner.run(inputs, token_ids=ids)
    run = timed(lambda: eng.runner.run(inputs, token_ids=ids))
    replayed = eng.runner.last_run_replayed
    fwd = timed(graphs.replay_last) if replayed else run
    head = timed(lambda: eng.sampler(eng.model.compute_logits(hidden), params))
    for r in rids:
        eng.release(r)
    return {"batch": batch, "ctx": ctx, "forward_ms": fwd, "run_with_plan_ms": run, "lm_head_sample_ms": head,
            "replayed": replayed}


def prefill(eng: KVCacheEngine, batch: int, length: int, gen: torch.Generator, reps: int = 3) -> dict:
    times = []
    for rep in range(reps + 1):
        items = [ForwardItem(f"p{rep}_{i}", token_ids=torch.randint(0, eng.model.config.vocab_size, (length,), generator=gen))
                 for i in range(batch)]
        sync()
        t0 = time.perf_counter()
        eng.forward(items)
        sync()
        if rep:
            times.append(time.perf_counter() - t0)
        for it in items:
            eng.release(it.request_id)
    t = statistics.median(times)
    return {"batch": batch, "length": length, "ms": t * 1e3, "tok_s": batch * length / t}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="2 small layers on CPU: a smoke run of this script")
    ap.add_argument("--hf-order", default="16,64,1,8,32", help="baseline batches, most wanted first")
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds; skip baseline runs past it")
    ap.add_argument("--kernels", default="auto", help="EngineConfig.kernels: auto | torch | flashinfer")
    ap.add_argument("--graph-attention", default="auto", help="EngineConfig.graph_attention: auto | flashinfer | triton")
    ap.add_argument("--compare-graph-attention", default="",
                    help="also run a second engine with this graph_attention at --compare-batches (same run)")
    ap.add_argument("--compare-config", default="",
                    help='JSON of EngineConfig fields for another engine at --compare-batches (same run), e.g. '
                         '{"graph_attention": "flashinfer"}; several separated by ";", run in that order ({}: the '
                         'default engine again, a drift check)')
    ap.add_argument("--compare-batches", default="1,16,64")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="EngineConfig.max_num_seqs (the largest graph)")
    ap.add_argument("--hf-repeats", type=int, default=1,
                    help="timed transformers generate calls per batch after the warm-up; the median is compared")
    args = ap.parse_args()
    t_begin = time.time()
    gen = torch.Generator().manual_seed(0)
    dev = "cpu" if args.tiny else "cuda"
    shape = dict(SHAPE, num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1000,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64) if args.tiny else SHAPE
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    r: dict = {"device": name, "torch": torch.__version__, "args": vars(args), "shape": shape}

    def save():
        r["elapsed_s"] = time.time() - t_begin
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)

    r["hbm_copy_stats"] = {}
    bw = copy_bandwidth(dev, GIB // 64 if args.tiny else 2 * GIB, stats=r["hbm_copy_stats"])
    r["hbm_copy_GBps"] = bw / 1e9  # the roofline's bandwidth: the best copy
    hf, ours = build_models(shape, dev)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())  # tied head counted once
    r["params"] = sum(p.numel() for p in ours.parameters())
    kv_spec = ours.config.kv_spec(16, torch.bfloat16)
    r["kv_bytes_per_token"] = kv_spec.bytes_per_token
    per_seq_4k = -(-4096 // 16) * kv_spec.bytes_per_page
    r["max_4k_seqs_in_60GiB"] = (60 * GIB) // per_seq_4k
    cfg = EngineConfig(page_size=16, kv_cache_bytes=GIB // 8 if args.tiny else 12 * GIB, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=8192, attention="torch" if args.tiny else "flashinfer",
                       cuda_graphs=True, overlap=True, kernels=args.kernels, graph_attention=args.graph_attention)
    t0 = time.time()
    eng = KVCacheEngine(ours, cfg)
    r["engine_init_s"] = time.time() - t0
    r["cuda_graphs"], r["overlap"], r["kernels"] = eng.cuda_graphs, eng.overlap, eng.ops.name
    graphs = eng.runner.graphs
    r["graph_attention"] = {str(b): a for b, a in graphs.attention.items()} if graphs else None
    r["sanity_vs_transformers"] = sanity(hf, eng, gen)
    r["graphs_vs_eager"] = graph_consistency(ours, eng, gen)
    print(json.dumps({k: r[k] for k in ("sanity_vs_transformers", "graphs_vs_eager")}), flush=True)
    save()
    r["prefill"] = [prefill(eng, 1, 2048, gen), prefill(eng, 16, 512, gen)]
    print("prefill", json.dumps(r["prefill"]), flush=True)
    save()
    r["ours"] = {}
    for b in map(int, args.batches.split(",")):
        res = run_ours(eng, b, args.prompt, args.new, gen)
        avg_ctx = args.prompt + args.new / 2
        floor_s = (weight_bytes + b * avg_ctx * kv_spec.bytes_per_token) / bw
        res["roofline_floor_ms"] = floor_s * 1e3
        res["step_over_floor"] = res["decode_step_ms_median"] / (floor_s * 1e3)
        r["ours"][str(b)] = res
        print("ours", b, json.dumps(res), flush=True)
        save()
    r["engine_stats"] = dict(vars(eng.stats))
    if dev == "cuda":
        r["device_breakdown"] = [device_breakdown(eng, b, args.prompt + args.new // 2, gen) for b in (1, 16, 64)]
        print("breakdown", json.dumps(r["device_breakdown"]), flush=True)
    eng.overlap = False  # the same engine without pipelining, for comparison
    r["ours_no_overlap"] = {}
    for b in (1, 16, 64):
        r["ours_no_overlap"][str(b)] = run_ours(eng, b, args.prompt, args.new, gen)
        print("ours_no_overlap", b, json.dumps(r["ours_no_overlap"][str(b)]), flush=True)
    eng.overlap = True
    save()
    compares = []
    if args.compare_graph_attention:
        compares.append((f"ours_graph_attention_{args.compare_graph_attention}",
                         {"graph_attention": args.compare_graph_attention}))
    for i, text in enumerate(c for c in args.compare_config.split(";") if c.strip()):
        change = json.loads(text)
        label = "ours_" + "_".join(f"{k}_{v}" for k, v in change.items()) if change else "ours_default_again"
        compares.append((label if label not in dict(compares) else f"{label}_{i}", change))
    for label, change in compares:  # the same model and run, one EngineConfig field changed
        del eng
        gc.collect()
        torch.cuda.empty_cache()
        # the weights as a fresh load lays them out: the engine before may have stored some row-major
        # for its Triton GEMMs, which would slow this engine's cuBLAS ones (its graphs are gone)
        set_weight_layout(ours, column_major=dev == "cuda")
        eng = KVCacheEngine(ours, dataclasses.replace(cfg, **change))
        graphs = eng.runner.graphs
        res = {"config_change": change,
               "graph_attention": {str(b): a for b, a in graphs.attention.items()} if graphs else None}
        for b in map(int, args.compare_batches.split(",")):
            res[str(b)] = run_ours(eng, b, args.prompt, args.new, gen)
            res[str(b)]["ours_default_over_this"] = r["ours"][str(b)]["decode_step_ms_median"] / res[str(b)][
                "decode_step_ms_median"] if str(b) in r["ours"] else None
            print("compare", label, b, json.dumps(res[str(b)]), flush=True)
        if dev == "cuda":
            res["device_breakdown"] = [device_breakdown(eng, b, args.prompt + args.new // 2, gen) for b in (1, 16, 64)]
            print("compare breakdown", json.dumps(res["device_breakdown"]), flush=True)
        r[label] = res
        save()
    r["hf_static"] = {}
    longest = 0.0
    for b in (int(x) for x in args.hf_order.split(",") if x):
        left = args.deadline - time.time() if args.deadline else float("inf")
        if left < max(60.0, 1.3 * longest):
            r["hf_static"][str(b)] = {"skipped": f"time budget ({left:.0f} s left)"}
            continue
        t0 = time.time()
        try:
            res = run_hf(hf, b, args.prompt, args.new, gen, args.hf_repeats)
        except Exception as e:  # record and go on: our numbers are already saved
            r["hf_static"][str(b)] = {"error": repr(e)[:500]}
            save()
            continue
        longest = max(longest, time.time() - t0)
        ours_b = r["ours"].get(str(b))
        if ours_b:
            res["ours_speedup"] = ours_b["decode_tok_s"] / res["tok_s"]
        r["hf_static"][str(b)] = res
        print("hf", b, json.dumps(res), flush=True)
        save()
    save()


if __name__ == "__main__":
    main()
