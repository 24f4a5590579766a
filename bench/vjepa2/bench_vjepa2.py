"""V-JEPA 2 / V-JEPA 2-AC throughput, in one process (full-size random weights, bf16 on a GPU).

1. encoder: clips/s and tokens/s on 64 frames at 256^2 (B = 1, 4), ours against transformers'
   ``VJEPA2Model`` (SDPA, same weights), with the FLOP floor at the measured bf16 matmul peak;
2. rollout: the AC predictor (ViT-g 1408 -> 1024 wide, 24 layers) from one context frame at batch
   100 and 400 for H in {2, 8, 24, 30}: our cached rollout against the reference-style loop that
   recomputes the whole context every step (written here with our modules); rows run in chunks
   whose K/V cache fits ``--cache-gib``;
3. plan: one full CEM call at the reference ``WorldModel``'s defaults (rollout 2, 400 samples,
   top-k 10, 10 iterations), its rollouts as one CUDA graph per iteration, against its FLOPs at
   the measured peak.

    python bench/vjepa2/bench_vjepa2.py --device cuda --out bench/results/vjepa2/h100.json
    python bench/vjepa2/bench_vjepa2.py --device cpu --tiny --out /tmp/vjepa2-smoke.json   # a smoke run

Importing this file does nothing; everything runs under ``main``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
from gpu_timing import profile_parts, wall_s  # noqa: E402  (the engine benchmarks' timing helpers)


def timed(fn, device: str, iters: int = 5, warmup: int = 1) -> float:
    """Median seconds per call."""
    return statistics.median(wall_s(fn, device, iters, warmup))


def peak_tflops(device: str, dtype: torch.dtype) -> float:
    n = 8192 if device.startswith("cuda") else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    s = timed(lambda: a @ b, device, iters=10, warmup=3)
    return 2 * n**3 / s / 1e12


# -- FLOPs (multiply-adds x 2; LayerNorms, softmax and RoPE left out) --------------------------------

def block_flops(tokens: int, keys: int, dim: int, mlp: int) -> float:
    return 2 * tokens * dim * (3 * dim + dim + 2 * mlp) + 4 * tokens * keys * dim


def encoder_flops(cfg, frames: int, crop: int) -> float:
    n = (frames // cfg.tubelet) * (crop // cfg.patch) ** 2
    embed = 2 * n * cfg.dim * cfg.in_chans * cfg.tubelet * cfg.patch**2
    return embed + cfg.depth * block_flops(n, n, cfg.dim, cfg.mlp_dim)


def ac_step_flops(ac, enc, t: int) -> float:
    """Frame t of a cached rollout: its 2 + P tokens against (t + 1) frames of keys."""
    f = 2 + enc.tokens_per_tubelet
    io = 2 * enc.tokens_per_tubelet * enc.dim * ac.dim * 2 + 2 * 2 * 7 * ac.dim
    return io + ac.depth * block_flops(f, (t + 1) * f, ac.dim, ac.mlp_dim)


def ac_recompute_flops(ac, enc, frames: int) -> float:
    """The reference's forward over ``frames`` frames (a dense masked attention over all of them)."""
    f = 2 + enc.tokens_per_tubelet
    n = frames * f
    io = 2 * frames * enc.tokens_per_tubelet * enc.dim * ac.dim * 2 + frames * 2 * 2 * 7 * ac.dim
    return io + ac.depth * block_flops(n, n, ac.dim, ac.mlp_dim)


# -- the parts ------------------------------------------------------------------------------------

def bench_encoder(args, dtype, peak) -> dict:
    from transformers import VJEPA2Config, VJEPA2Model

    from mstar.models.vjepa2 import weights

    hf_kw = dict(crop_size=args.crop, frames_per_clip=args.frames)
    if args.tiny:
        hf_kw.update(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, patch_size=8, pred_hidden_size=32,
                     pred_num_attention_heads=2, pred_num_hidden_layers=1)
    torch.manual_seed(0)
    hf = VJEPA2Model(VJEPA2Config(**hf_kw, attn_implementation="sdpa")).to(args.device, dtype).eval()
    loaded = weights.from_hf({k: v for k, v in hf.state_dict().items()}, weights.VJepa2Config.from_hf(hf_kw))
    loaded.predictor = None
    enc = weights.build(loaded, args.device, dtype)[0]
    cfg = loaded.config.encoder
    out = {"config": asdict(cfg), "frames": args.frames, "crop": args.crop, "flops_per_clip": encoder_flops(cfg, args.frames, args.crop),
           "batches": []}
    tokens = (args.frames // cfg.tubelet) * (args.crop // cfg.patch) ** 2
    from mstar.models.vjepa2.modules import attention_kernel, compile_blocks, sdpa

    kernels = {spec: attention_kernel(spec) for spec in {v.split("/", 1)[1] for v in args.encoder_variants}}
    for B in args.encoder_batches:
        video = torch.randn(B, args.frames, 3, args.crop, args.crop, device=args.device, dtype=dtype)
        pixels = video.transpose(1, 2)
        with torch.inference_mode():
            theirs = hf(pixel_values_videos=video, skip_predictor=True).last_hidden_state
            run_hf = partial(hf, pixel_values_videos=video, skip_predictor=True)
            t_hf_first = timed(run_hf, args.device, args.iters)
            by_variant, diffs = {}, {}
            for variant in args.encoder_variants:  # "<eager|compiled>/<attention>"
                mode, spec = variant.split("/", 1)
                compile_blocks(enc, None if mode == "eager" else "inductor")
                enc.attend = kernels[spec]
                diffs[variant] = (enc(pixels).float() - theirs.float()).abs().max().item()  # compiles on the first call
                by_variant[variant] = timed(partial(enc, pixels), args.device, args.iters)
            attn = {spec: timed(partial(k, *(torch.randn(B, tokens, cfg.heads, cfg.dim // cfg.heads, device=args.device, dtype=dtype)
                                             for _ in range(3))), args.device, args.iters)
                    for spec, k in kernels.items()}
            compile_blocks(enc, None)
            enc.attend = sdpa
            # timed again after ours: the first timing of a process ran 1.0-1.7x slower from call to
            # call at B = 1 (41.6-70.4 ms on one H200); the baseline is the faster of the two
            t_hf_again = timed(run_hf, args.device, args.iters)
            t_hf = min(t_hf_first, t_hf_again)
        best = min(by_variant, key=by_variant.get)
        t_ours = by_variant[best]
        floor = out["flops_per_clip"] * B / (peak * 1e12)
        attn_flops = 4 * B * tokens * tokens * cfg.dim
        if args.profile and B == args.encoder_batches[0]:
            mode, spec = best.split("/", 1)
            compile_blocks(enc, None if mode == "eager" else "inductor")
            enc.attend = kernels[spec]
            with torch.inference_mode():
                profile_parts(args.profile, {f"encoder_b{B}": partial(enc, pixels)}, args.device)
            compile_blocks(enc, None)
            enc.attend = sdpa
        row = {"batch": B, "ours_s": t_ours, "ours_variant": best, "ours_s_by_variant": by_variant,
               "max_abs_diff_by_variant": diffs, "transformers_s": t_hf,
               "transformers_s_before_after": [t_hf_first, t_hf_again], "speedup": t_hf / t_ours,
               "ours_clips_per_s": B / t_ours, "transformers_clips_per_s": B / t_hf,
               "ours_tokens_per_s": B * tokens / t_ours, "transformers_tokens_per_s": B * tokens / t_hf,
               "flop_floor_s": floor, "ours_over_floor": t_ours / floor,
               "attention_alone_s": attn, "attention_alone_tflops": {k: attn_flops / v / 1e12 for k, v in attn.items()},
               "attention_share_of_flops": cfg.depth * attn_flops / (out["flops_per_clip"] * B)}
        out["batches"].append(row)
        print(f"encoder B={B}: ours {B / t_ours:.2f} clips/s ({best}), transformers {B / t_hf:.2f} clips/s "
              f"(x{t_hf / t_ours:.2f}); {t_ours / floor:.2f}x the FLOP floor; max |diff| {diffs[best]:.3g}; "
              f"by variant (ms) {({k: round(v * 1e3, 2) for k, v in by_variant.items()})}; attention alone (TFLOP/s) "
              f"{({k: round(v, 1) for k, v in row['attention_alone_tflops'].items()})}", flush=True)
    del hf, enc
    return out


def ac_model(args, dtype):
    from mstar.models.vjepa2.config import ACConfig, EncoderConfig
    from mstar.models.vjepa2.modules import ACPredictor

    if args.tiny:
        enc, ac = EncoderConfig(dim=48, depth=1, heads=4, mlp_dim=96, patch=4, crop=16), ACConfig(dim=64, depth=2, heads=4, mlp_dim=256)
    else:  # V-JEPA 2-AC: the ViT-g encoder's width, the 1024-wide predictor
        enc, ac = EncoderConfig(dim=1408, depth=40, heads=22, mlp_dim=6144), ACConfig()
    torch.manual_seed(0)
    pred = ACPredictor(ac, enc, use_extrinsics=False).to(args.device, dtype).eval()
    return pred, enc, ac


def chunk_rows(args, pred, steps: int) -> int:
    cache = pred.new_cache(1, 1, device="meta")
    per_row = cache.nbytes * steps
    return max(1, min(args.max_rows, int(args.cache_gib * 2**30 // per_row)))


def bench_rollout(args, dtype, peak) -> dict:
    from mstar.models.vjepa2 import rollout
    from mstar.models.vjepa2.modules import compile_blocks
    from mstar.models.vjepa2.pose import new_pose

    pred, enc, ac = ac_model(args, dtype)
    P, E = enc.tokens_per_tubelet, enc.dim

    def inputs(B, H):
        g = torch.Generator(device="cpu").manual_seed(1)
        ctx = rollout.normalize(torch.randn(B, 1, P, E, generator=g)).to(args.device, dtype)
        acts = (torch.randn(B, H, 7, generator=g) * 0.05).to(args.device)
        states = (torch.randn(B, 1, 7, generator=g) * 0.3).to(args.device)
        return ctx, acts, states

    def ours(ctx, acts, states):  # the blocks as served (compiled on a GPU) unless --eager-rollout
        compile_blocks(pred, "inductor" if args.device.startswith("cuda") and not args.eager_rollout else None)
        rows = chunk_rows(args, pred, acts.shape[1])
        return torch.cat([rollout.rollout(pred, c, a, s)[0][:, -1]
                          for c, a, s in zip(ctx.split(rows), acts.split(rows), states.split(rows), strict=True)])

    def recompute(ctx, acts, states):  # the reference's loop: eager blocks
        compile_blocks(pred, None)
        out = []
        for c, a, s in zip(ctx.split(args.recompute_rows), acts.split(args.recompute_rows),
                           states.split(args.recompute_rows), strict=True):
            frames, poses = c, s
            for h in range(a.shape[1]):
                nxt = pred(frames.flatten(1, 2), a[:, :h + 1], poses)[:, -P:]
                frames = torch.cat([frames, rollout.normalize(nxt).unsqueeze(1)], 1)
                poses = torch.cat([poses, new_pose(poses[:, -1], a[:, h]).unsqueeze(1)], 1)
            out.append(frames[:, -1])
        return torch.cat(out)

    res = {"predictor": asdict(ac), "encoder_width": E, "tokens_per_frame": P + 2, "runs": [],
           "ours_blocks": "eager" if args.eager_rollout or not args.device.startswith("cuda") else "compiled"}
    with torch.inference_mode():
        for B in args.rollout_batches:
            for H in args.horizons:
                ctx, acts, states = inputs(B, H)
                t_ours = timed(partial(ours, ctx, acts, states), args.device, args.iters)
                n = min(B, args.recompute_sample) if args.recompute_sample else B
                t_re = timed(partial(recompute, ctx[:n], acts[:n], states[:n]), args.device, 1, warmup=1 if H <= 8 else 0)
                t_re_full = t_re * B / n  # rows are independent: time is linear in rows at these sizes
                diff = (ours(ctx[:n], acts[:n], states[:n]).float() - recompute(ctx[:n], acts[:n], states[:n]).float()
                        ).abs().max().item() if H <= 8 else None
                flops_ours = B * sum(ac_step_flops(ac, enc, t) for t in range(H))
                flops_re = B * sum(ac_recompute_flops(ac, enc, t + 1) for t in range(H))
                row = {"batch": B, "steps": H, "ours_s": t_ours, "recompute_s": t_re_full,
                       "recompute_measured_rows": n, "speedup": t_re_full / t_ours,
                       "ours_frames_per_s": B * H / t_ours, "ours_tflops": flops_ours / t_ours / 1e12,
                       "recompute_tflops": flops_re / t_re_full / 1e12, "flop_ratio": flops_re / flops_ours,
                       "cache_rows_per_chunk": chunk_rows(args, pred, H), "max_abs_diff_final_frame": diff,
                       "ours_over_floor": t_ours / (flops_ours / (peak * 1e12))}
                res["runs"].append(row)
                print(f"rollout B={B} H={H}: ours {t_ours:.3f} s, recompute {t_re_full:.3f} s (x{row['speedup']:.1f}, "
                      f"FLOP ratio {row['flop_ratio']:.1f})", flush=True)
    return res


def bench_plan(args, dtype, peak) -> dict:
    from mstar.models.vjepa2 import cem, rollout
    from mstar.models.vjepa2.modules import compile_blocks
    from mstar.services.engines.loop_graph import LoopGraphs

    pred, enc, ac = ac_model(args, dtype)
    P, E = enc.tokens_per_tubelet, enc.dim
    cfg = cem.CEMConfig(samples=16, topk=4, cem_steps=2) if args.tiny else cem.CEMConfig()
    g = torch.Generator().manual_seed(2)
    context = rollout.normalize(torch.randn(1, P, E, generator=g)).to(args.device, dtype)
    goal = rollout.normalize(torch.randn(P, E, generator=g)).to(args.device, dtype)
    state = (torch.randn(1, 7, generator=g) * 0.3).to(args.device)
    rows = min(cfg.samples, chunk_rows(args, pred, cfg.rollout))
    graphs = args.device.startswith("cuda") and not args.no_graphs
    flops = cfg.cem_steps * cfg.samples * sum(ac_step_flops(ac, enc, i) for i in range(cfg.rollout))
    floor = flops / (peak * 1e12)
    out = {"cem": asdict(cfg), "flops": flops, "floor_s": floor, "cuda_graphs": graphs, "rows_per_graph": rows,
           "variants": {}}
    probe = (torch.randn(cfg.samples, cfg.rollout, 7, generator=g) * cfg.maxnorm).clamp(-cfg.maxnorm, cfg.maxnorm).to(args.device)
    finals: dict[str, torch.Tensor] = {}
    for variant in args.plan_variants:  # eager | compiled: the predictor's blocks (as the encoder's)
        compile_blocks(pred, None if variant == "eager" else "inductor")
        loops = LoopGraphs(rollout.RolloutBody(pred, cfg.rollout), cfg.rollout, ("frame", "pose"), args.device,
                           buckets=(rows,) if graphs else (), name="plan")

        def world_model(actions, loops=loops):
            return torch.cat([loops.run({"frame": context.expand(len(a), -1, -1), "pose": state.expand(len(a), -1),
                                         "actions": a})["frame"] for a in actions.split(rows)])

        def plan(world_model=world_model):
            return cem.plan(cfg, world_model, goal, generator=torch.Generator().manual_seed(3))

        with torch.inference_mode():
            t = timed(plan, args.device, iters=max(1, args.iters // 2), warmup=1)  # the warm-up captures the graphs
            finals[variant] = world_model(probe).float()  # one CEM batch of rollouts: the variants' numbers
            if args.profile and variant == args.plan_variants[-1]:
                profile_parts(args.profile, {f"plan_{variant}": plan}, args.device, reps=1)
        out["variants"][variant] = {"seconds": t, "over_floor": t / floor, "graph_stats": asdict(loops.stats),
                                    "max_abs_diff_vs_first": (finals[variant] - finals[args.plan_variants[0]]).abs().max().item()}
        print(f"plan at the defaults ({variant}): {t:.3f} s, {flops / 1e12:.1f} TFLOP, floor {floor:.3f} s "
              f"({t / floor:.2f}x); graphs {loops.stats}; final frames vs {args.plan_variants[0]}: max |diff| "
              f"{out['variants'][variant]['max_abs_diff_vs_first']:.3g}", flush=True)
        del loops, world_model, plan  # their graphs and pool freed before the next variant captures
    compile_blocks(pred, None)
    best = min(out["variants"], key=lambda v: out["variants"][v]["seconds"])
    out.update(best=best, seconds=out["variants"][best]["seconds"], over_floor=out["variants"][best]["over_floor"])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny configs and sizes (a CPU smoke run)")
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="encoder,rollout,plan")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--crop", type=int, default=256)
    p.add_argument("--encoder-batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rollout-batches", type=int, nargs="+", default=[100, 400])
    p.add_argument("--horizons", type=int, nargs="+", default=[2, 8, 24, 30])
    p.add_argument("--cache-gib", type=float, default=24.0, help="K/V cache per rollout chunk")
    p.add_argument("--max-rows", type=int, default=400)
    p.add_argument("--recompute-rows", type=int, default=25, help="rows per chunk of the recompute loop")
    p.add_argument("--recompute-sample", type=int, default=0,
                   help="time the recompute loop on this many rows and scale to the batch (0: all rows)")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--eager-rollout", action="store_true", help="our rollouts with eager blocks (records before 2026-11-26c)")
    p.add_argument("--plan-variants", nargs="+", default=["eager", "compiled"],
                   help="the predictor's blocks in the plan (as --encoder-variants)")
    p.add_argument("--encoder-variants", nargs="+",
                   default=["eager/sdpa", "compiled/sdpa", "compiled/sdpa:flash"],
                   help="<eager|compiled>/<attention knob> runs of our encoder to time (the best is reported); "
                        "compiled: the blocks as served on a GPU (compile_blocks)")
    p.add_argument("--profile", metavar="DIR", help="also write the best encoder variant's kernel table (B = first)")
    args = p.parse_args(argv)
    if args.tiny:
        args.frames, args.crop = min(args.frames, 4), min(args.crop, 32)
        args.encoder_batches, args.rollout_batches = [1, 2], [4, 8]
        args.horizons, args.iters, args.recompute_rows = [2, 4], min(args.iters, 2), 4
        args.encoder_variants = ["eager/sdpa", "eager/sdpa:math"]
    if not args.device.startswith("cuda"):  # compiled blocks run a Triton kernel: CUDA only (or its interpreter)
        args.plan_variants = ["eager"]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    peak = peak_tflops(args.device, dtype)
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
              "dtype": str(dtype), "torch": torch.__version__, "measured_matmul_peak_tflops": peak, "tiny": args.tiny}
    print(f"{result['device']}: measured {dtype} matmul peak {peak:.1f} TFLOP/s", flush=True)
    parts = args.parts.split(",")
    for name, fn in (("encoder", bench_encoder), ("rollout", bench_rollout), ("plan", bench_plan)):
        if name in parts:
            result[name] = fn(args, dtype, peak)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
                result[name]["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
            with open(args.out, "w") as f:  # after every part: a part that fails keeps the ones before it
                json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
