"""What the sequence-parallel layout's exchanges cost (issue 33): BAGEL text-to-image over N ranks
(``BagelLM``'s sequence_parallel, one process per GPU, as the ``llm`` group of
``sequence_parallel.yaml`` runs them), without the mesh around it.

Rank 0 runs the request as ``BagelPipeline`` does (warm-up, then timed), then profiles flow steps
with the CUDA profiler: each step's GPU time, the time of the ranks' collectives in it (NCCL
kernels: the K/V all-gather of every layer, the hidden states at the end, the step's inputs), and
the bytes they moved, counted on the calls. One rank (``--ranks 1``) is the baseline.

    python bench/bagel/sp_share.py --ckpt /tmp/bagel-full --ranks 3 --out sp3.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PROMPT = "a photo of a red cat sitting on a blue chair"


def rank_main(rank: int, args: argparse.Namespace, init: str) -> None:
    import torch

    from mstar.models.bagel.flow import FlowParams, draw_noise, schedule
    from mstar.models.bagel.media import Fit
    from mstar.models.bagel.pipeline import BagelPipeline, flow_step
    from mstar.services.engines.tensor_parallel import TensorParallel, TPSpec

    cpu = args.device == "cpu"  # a smoke run (tiny checkpoint): no kernels to time
    device = "cpu" if cpu else f"cuda:{rank}"
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    if not cpu:
        torch.cuda.set_device(device)
    torch.set_num_threads(1) if cpu else None
    group = TensorParallel(TPSpec(rank, args.ranks, init), device) if args.ranks > 1 else None
    fits = ((96, 48), (70, 42)) if cpu else ((1024, 512), (980, 224))
    pipe = BagelPipeline(args.ckpt, device, torch.float32 if cpu else torch.bfloat16, Fit(*fits[0], 16),
                         Fit(*fits[1], 14), sequence_parallel=group)
    moved = [0]
    if group is not None:  # bytes each collective hands this rank
        gather, broadcast = group.all_gather, group.broadcast
        group.all_gather = lambda x, dim=-1: (moved.__setitem__(0, moved[0] + x.numel() * x.element_size() * group.size)
                                              or gather(x, dim))
        group.broadcast = lambda x: moved.__setitem__(0, moved[0] + x.numel() * x.element_size()) or broadcast(x)
    if rank > 0:
        pipe.lm.follow()
        torch.distributed.barrier()
        group.close()
        return
    p = FlowParams(args.size, args.size)
    times = []
    for _ in range(1 + args.reps):
        sync()
        t0 = time.perf_counter()
        pipe.run("text_to_image", PROMPT, params=p, seed=1)
        sync()
        times.append(time.perf_counter() - t0)
    rec = {"ranks": args.ranks, "device": "cpu" if cpu else torch.cuda.get_device_name(0), "size": args.size,
           "request_s": statistics.median(times[1:]), "request_times_s": times[1:]}
    # flow steps alone, guided (both CFG branches in one pass), under the profiler
    from torch.profiler import ProfilerActivity, profile

    lm, rid = pipe.lm, "profiled"
    h = w = args.size // pipe.cfg.latent_downsample
    x = draw_noise(1, h * w, pipe.cfg.patch_latent_dim)[1]
    t, dt = (v.tolist() for v in schedule(p.num_timesteps, p.shift))
    lm.prefill_text([(rid, ("main",), pipe.text_ids(PROMPT))])
    lm.prefill_text([(rid, ("cfg_text",), pipe.text_ids(""))])
    steps = [(rid, x, t[i], dt[i], p, ("main", "cfg_text")) for i in range(args.steps)]
    flow_step(lm, [steps[0]])  # warm
    sync()
    moved[0] = 0
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU if cpu else ProfilerActivity.CUDA]) as prof:
        for s in steps:
            flow_step(lm, [s])
        sync()
    wall = (time.perf_counter() - t0) / args.steps
    lm.release(rid)
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
    nccl = sum(e.self_device_time_total for e in kernels if "nccl" in e.key.lower()) / 1e3 / args.steps
    rec |= {"step_wall_ms": wall * 1e3, "step_gpu_ms": total, "step_collectives_ms": nccl,
            "collectives_share_of_step": nccl / (wall * 1e3) if not cpu else None, "bytes_to_rank0_per_step": moved[0] / args.steps,
            "top_kernels_ms_per_step": {e.key[:80]: e.self_device_time_total / 1e3 / args.steps
                                        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]}}
    if group is not None:
        pipe.lm.close()
        torch.distributed.barrier()
        group.close()
    args.out.write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="guided flow steps profiled")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import multiprocessing as mp

    from mstar.services.engines.tensor_parallel import Rendezvous

    init = Rendezvous().init_method  # removed at exit
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, args, init)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")


if __name__ == "__main__":
    main()
