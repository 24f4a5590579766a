"""Moving a request's K/V between two KV-cache engines on one GPU (prefill on one node group,
decode on another): ``export_kv`` (one gather out of the pages), ``import_request`` (pages
taken, one scatter in, the request queued) and, between two processes, the project's CUDA IPC
transport (``CudaIpcSender.encode_into`` -> ``CudaIpcReader.read``, the frame's bytes passed
over a queue instead of a gRPC stream).

A Llama-3.2-3B-shaped model (decode_bench.SHAPE: 28 layers, 8 KV heads of 128, bf16:
112 KiB of K/V a token) with random weights; the two engines share it. The sender's sequence
is placed with ``import_request`` of random K/V (the values do not change the cost), its pages
either handed out in order or shuffled (the cache filled with one-page sequences released in
random order first, as after churn). Per context: median of ``--repeats`` after ``--warmup``
of CUDA-event times, ms per 1k tokens and GB/s of K/V bytes (each is read once and written
once; a plain device-to-device copy of the same bytes is the reference), the round trip
checked bit for bit, and one decode step of the imported request.

    python bench/engines/kv_handoff_bench.py --out kv_handoff.json
    python bench/engines/kv_handoff_bench.py --device cpu --tiny --out /tmp/kv_handoff.json  # smoke test
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import queue
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from decode_bench import SHAPE  # noqa: I001  (same folder)

from mstar.services.engines import EngineConfig, KVCacheEngine, LlamaConfig, LlamaForCausalLM, SamplingParams

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0)
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def build_model(shape: dict, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_hf(shape))
    model = model.to_empty(device=device).to(dtype)  # RotaryEmbedding refills its inv_freq
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.requires_grad_(False).eval()


def make_engine(model, num_tokens: int, page_size: int) -> KVCacheEngine:
    spec = model.config.kv_spec(page_size, next(model.parameters()).dtype)
    cfg = EngineConfig(page_size=page_size, kv_cache_bytes=spec.bytes_per_page * (num_tokens // page_size + 2),
                       cuda_graphs=False, overlap=False)
    return KVCacheEngine(model, cfg)


def shuffle_free_pages(eng: KVCacheEngine, seed: int = 0) -> None:
    """Fill the cache with one-page sequences and free them in random order: later sequences
    get pages in that order (the free list is last in, first out)."""
    c = eng.cache
    one = torch.zeros(c.spec.num_layers, 2, c.page_size, c.spec.num_kv_heads, c.spec.head_dim,
                      dtype=c.spec.dtype, device=c.device)
    names = [f"fill{i}" for i in range(c.num_free_pages)]
    for name in names:
        c.scatter(name, "main", one)
    random.Random(seed).shuffle(names)
    for name in names:
        c.release(name)


def timed_ms(device: torch.device, fn: Callable[[int], object], warmup: int, repeats: int,
             after: Callable[[int], object] = lambda i: None) -> list[float]:
    """Times of ``fn(i)`` past the warm-up: CUDA events on a GPU (the host's part counts
    where the device waits for it), else the wall clock; ``after(i)`` runs untimed."""
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(i)
            b.record()
            b.synchronize()
            took = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            fn(i)
            took = (time.perf_counter() - t0) * 1e3
        after(i)
        if i >= warmup:
            times.append(took)
    return times


def summary(name: str, times: list[float], nbytes: int, tokens: int) -> dict:
    med = statistics.median(times)
    return {f"{name}_ms": med, f"{name}_min_ms": min(times), f"{name}_ms_per_1k_tokens": med * 1000 / tokens,
            f"{name}_GBps": nbytes / med / 1e6}


def checksum(t: torch.Tensor) -> int:
    return int(t.contiguous().view(torch.int16).sum(dtype=torch.int64).item())


# -- the other process: CUDA IPC reads --------------------------------------------------------
def ipc_receiver(inbox, outbox, device: str) -> None:
    from mstar.services.transport.cuda_ipc import CudaIpcReader
    from mstar.v1 import tensor_pb2

    torch.cuda.set_device(device)
    reader = CudaIpcReader()
    try:
        while (frame := inbox.get()) is not None:
            msg = tensor_pb2.Tensor.FromString(frame)
            acks: list[int] = []
            t = reader.read(msg, acks)  # copied out and waited for
            t1 = time.perf_counter()
            outbox.put({"t1": t1, "acks": acks, "checksum": checksum(t), "shape": list(t.shape)})
    finally:
        reader.close()


def ipc_times(kv: torch.Tensor, warmup: int, repeats: int) -> list[float]:
    """ms from before ``encode_into`` (copy into a pooled exported buffer, waited for) until
    the tensor is complete in the other process's GPU memory (one clock for both)."""
    from mstar.services.transport.cuda_ipc import CudaIpcSender
    from mstar.v1 import tensor_pb2

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=ipc_receiver, args=(inbox, outbox, str(kv.device)), daemon=True)
    proc.start()
    sender, want, times = CudaIpcSender("kv_handoff_bench"), checksum(kv), []
    try:
        for i in range(warmup + repeats):
            torch.cuda.synchronize(kv.device)
            msg = tensor_pb2.Tensor()
            t0 = time.perf_counter()
            sender.encode_into(msg, "kv", kv)
            inbox.put(msg.SerializeToString())
            try:
                r = outbox.get(timeout=120)
            except queue.Empty:
                raise RuntimeError("the receiving process answered nothing for 120 s") from None
            if r["checksum"] != want or r["shape"] != list(kv.shape):
                raise RuntimeError(f"CUDA IPC: K/V arrived wrong: {r} (sent {list(kv.shape)}, checksum {want})")
            sender.release(r["acks"])
            if i >= warmup:
                times.append((r["t1"] - t0) * 1e3)
    finally:
        inbox.put(None)
        proc.join(30)
        sender.close()
    return times


# -- one context --------------------------------------------------------------------------------
def run_context(a: KVCacheEngine, b: KVCacheEngine, ctx: int, args, ipc: bool) -> dict:
    dev, spec = a.device, a.cache.spec
    ids = [i % a.model.config.vocab_size for i in range(ctx + 1)]  # the prompt's K/V plus its first sampled token
    src = torch.randn(spec.num_layers, 2, ctx, spec.num_kv_heads, spec.head_dim, device=dev).to(spec.dtype)
    a.import_request("src", ids, src, GREEDY)  # the sender's sequence, in its (maybe shuffled) pages
    out = a.export_kv("src")
    pages = a.cache.seq("src").pages
    row: dict = {"context": ctx, "kv_bytes": out.numel() * out.element_size(),
                 "round_trip_exact": bool(torch.equal(out, src)),
                 "sender_pages_consecutive": pages == list(range(pages[0], pages[0] + len(pages)))}
    nbytes = row["kv_bytes"]
    row |= summary("export", timed_ms(dev, lambda i: a.export_kv("src"), args.warmup, args.repeats), nbytes, ctx)
    row |= summary("import", timed_ms(dev, lambda i: b.import_request(f"r{i}", ids, out, GREEDY, num_output_tokens=1),
                                      args.warmup, args.repeats, after=lambda i: b.release(f"r{i}")), nbytes, ctx)
    dst = torch.empty_like(out)
    row |= summary("plain_copy", timed_ms(dev, lambda i: dst.copy_(out), args.warmup, args.repeats), nbytes, ctx)
    b.import_request("check", ids, out, GREEDY, num_output_tokens=1)  # continues: one decode step
    events = b.step()
    row["decode_step_after_import"] = [(e.request_id, e.token_id is not None) for e in events] == [("check", True)]
    row["receiver_round_trip_exact"] = bool(torch.equal(b.cache.gather("check")[:, :, :ctx], src))
    b.release("check")
    a.release("src")
    if ipc:
        row |= summary("cuda_ipc", ipc_times(out, args.warmup, args.repeats), nbytes, ctx)
        row["handoff_ms"] = row["export_ms"] + row["cuda_ipc_ms"] + row["import_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and short contexts (smoke test)")
    p.add_argument("--contexts", default=None, help="tokens, comma-separated (default 1024,4096,16384; tiny 64,256)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layouts", default="in_order,shuffled", help="the sender's pages: in_order, shuffled")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-ipc", action="store_true", help="skip the two-process CUDA IPC hand-off")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --device cpu --tiny for a smoke test")
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    contexts = [int(c) for c in (args.contexts or ("64,256" if args.tiny else "1024,4096,16384")).split(",")]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shape = TINY if args.tiny else SHAPE
    model = build_model(shape, device, dtype)
    spec = model.config.kv_spec(args.page_size, dtype)
    room = max(contexts) + 4 * args.page_size  # one sequence of the longest context and a decode step
    ipc = device.type == "cuda" and not args.no_ipc
    result = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__, "python": platform.python_version(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "shape": shape, "dtype": str(dtype),
              "page_size": args.page_size, "kv_bytes_per_token": spec.bytes_per_token, "warmup": args.warmup,
              "repeats": args.repeats, "timing": "CUDA events" if device.type == "cuda" else "wall clock",
              "rows": []}
    print(result["device"], "| torch", result["torch"], "|", spec.bytes_per_token, "B of K/V a token", flush=True)
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - {"in_order", "shuffled"}:
        sys.exit(f"--layouts: {sorted(unknown)} not among in_order, shuffled")
    for layout in layouts:
        for ctx in contexts:  # fresh engines: in_order means pages handed out in order
            a, b = make_engine(model, room, args.page_size), make_engine(model, room, args.page_size)
            if layout == "shuffled":
                shuffle_free_pages(a, seed=1)
                shuffle_free_pages(b, seed=2)
            row = {"layout": layout} | run_context(a, b, ctx, args, ipc)
            assert a.cache.allocator.num_used == 0 and b.cache.allocator.num_used == 0, "pages leaked"
            result["rows"].append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            del a, b
            if device.type == "cuda":
                torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
