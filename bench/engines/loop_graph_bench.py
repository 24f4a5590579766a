"""A flow-matching denoise loop, eager vs one CUDA graph (``LoopGraphs``), per batch size.

The body mimics a pi0.5 action expert's step at bf16: the action latent x [B, 50, 1024] (50
action tokens, width 1024) plus a per-row condition; LAYERS blocks of RMSNorm -> [1024 x 4096]
-> GELU -> [4096 x 1024] + residual, with the flow time t_i = 1 - i*dt (a Python float, frozen
into the graph) added before the first block; then the Euler step x <- x - dt * v. Random
weights: the compute is the same.

Both sides time ``LoopGraphs.run`` as a caller sees it (inputs copied in, outputs cloned out):
median of --reps runs between CUDA events after --warm untimed runs. The graph side's first run
(warm-up + capture) is timed separately on the host as capture_s.

    python bench/engines/loop_graph_bench.py --out loop_graph.json [--batches 1,4,16] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from mstar.services.engines.loop_graph import LoopGraphs

TOKENS, WIDTH, MLP = 50, 1024, 4096


def make_body(layers: int, steps: int, dev: str):
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(WIDTH, MLP, generator=gen) / WIDTH**0.5, torch.randn(MLP, WIDTH, generator=gen) / MLP**0.5,
           1 + 0.1 * torch.randn(WIDTH, generator=gen)) for _ in range(layers)]
    ws = [tuple(w.to(dev, torch.bfloat16) for w in layer) for layer in ws]
    t_embed = torch.randn(WIDTH, generator=gen).to(dev, torch.bfloat16)
    dt = 1.0 / steps

    def body(state, i):
        x = state["x"]
        h = x + state["cond"] + (1.0 - i * dt) * t_embed
        for up, down, gain in ws:
            hn = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype) * gain
            h = h + torch.nn.functional.gelu(hn @ up, approximate="tanh") @ down
        return {"x": x - dt * h}

    return body


def median_ms(loop: LoopGraphs, inputs: dict[str, torch.Tensor], reps: int, warm: int) -> float:
    for _ in range(warm):
        loop.run(inputs)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loop.run(inputs)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("loop_graph_bench.py needs a CUDA device: torch.cuda.is_available() is False here")
    from gpu_timing import record_row

    t0 = time.time()
    body = make_body(args.layers, args.steps, "cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
              "shape": {"tokens": TOKENS, "width": WIDTH, "mlp": MLP}, "rows": []}
    for b in map(int, args.batches.split(",")):
        gen = torch.Generator().manual_seed(b)
        inp = {"x": torch.randn(b, TOKENS, WIDTH, generator=gen).to("cuda", torch.bfloat16),
               "cond": torch.randn(b, 1, WIDTH, generator=gen).to("cuda", torch.bfloat16)}
        eager = LoopGraphs(body, args.steps, ("x",), "cuda", buckets=(), name="eager")
        graph = LoopGraphs(body, args.steps, ("x",), "cuda", name="graph")
        torch.cuda.synchronize()
        c0 = time.perf_counter()
        got = graph.run(inp)["x"]
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - c0
        want = eager.run(inp)["x"]
        rel_err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        eager_ms = median_ms(eager, inp, args.reps, args.warm)
        graph_ms = median_ms(graph, inp, args.reps, args.warm)
        flops = 2 * 2 * b * TOKENS * WIDTH * MLP * args.layers * args.steps
        record_row(result, {"batch": b, "bucket": graph.bucket(b), "eager_ms": eager_ms, "graph_ms": graph_ms,
                            "speedup": eager_ms / graph_ms, "graph_tflops": flops / graph_ms / 1e9,
                            "capture_s": capture_s, "rel_err_vs_eager": rel_err,
                            "graph_replays": graph.stats.graph_replays, "eager_runs": eager.stats.eager_runs}, args.out, t0)


if __name__ == "__main__":
    main()
