"""π0.5 inference latency on one GPU: this repository's model (as the node groups run it) against a
plain transformers implementation of the same inference, in one process, on the same random weights.

Full size (SigLIP So400m/14, Gemma-2B prefix, Gemma-300M expert), bf16, 3 cameras at 224 px, a
200-token prompt (all valid), 10 Euler steps from fixed noise, batches of 1, 4 and 16. For each, the
median of ``--reps`` after ``--warmup`` (CUDA-synchronised wall time):

- engine: ``vision`` (SigLIP over every camera + projector), ``prefix`` (the prefix K / V),
  ``loop_eager`` / ``loop_graph`` (the 10 Euler steps as ``LoopGraphs`` runs them: eagerly, or as one
  CUDA graph replay), ``e2e`` (vision + prefix + the graph loop: one action chunk);
- baseline: transformers' ``SiglipVisionModel``, a ``Linear`` projector, ``GemmaModel`` (2B) for the
  prefix cache and the expert's ``GemmaDecoderLayer`` weights driven as openpi's ``PI0Pytorch`` drives
  them (adaRMS patched in: a ``dense`` per norm from the per-step time MLP, prefix K / V concatenated
  into each layer's attention), each part under ``torch.compile`` where it compiles (``--compile``).

The engine's actions and the baseline's are compared (max |diff|, bf16). JSON to ``--out``.

    python bench/pi05/bench_pi05.py --out bench/results/pi05/bench.json
    python bench/pi05/bench_pi05.py --device cpu --tiny --out /tmp/pi05.json   # smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mstar.models.pi05.config import Pi05Config, tiny_config
from mstar.models.pi05.layers import time_embedding
from mstar.models.pi05.nodes import IMAGE_BUCKETS, encode_present, prefix_graphs, vision_graphs
from mstar.models.pi05.policy import Pi05, pixels_from_uint8
from mstar.models.pi05.weights import random_policy
from mstar.services.engines.loop_graph import LoopGraphs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
from gpu_timing import profile_parts, wall_s  # noqa: E402  (the engine benchmarks' timing helpers)


def median_ms(fn: Callable[[], object], device: str, reps: int, warmup: int) -> float:
    return 1e3 * statistics.median(wall_s(fn, device, reps, warmup))


def make_inputs(cfg: Pi05Config, b: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.randint(0, 256, (b, len(cfg.cameras), 3, s, s), generator=g, dtype=torch.uint8).to(device)
    image_mask = torch.ones(b, len(cfg.cameras), dtype=torch.bool, device=device)
    tokens = torch.randint(4, cfg.vocab, (b, cfg.max_token_len), generator=g).to(device)
    token_mask = torch.ones(b, cfg.max_token_len, dtype=torch.bool, device=device)
    noise = torch.randn(b, cfg.action_horizon, cfg.action_dim, generator=g).to(device)
    return images, image_mask, tokens, token_mask, noise


class Engine:
    """The model as the node groups run it: vision, prefix, then the loop through ``LoopGraphs``."""

    def __init__(self, policy: Pi05, device: str, dtype: torch.dtype, buckets: tuple[int, ...], graphs: bool,
                 compiled: bool):
        self.policy, self.dtype = policy, dtype
        self.vision_graphs = vision_graphs(policy.vision, device, IMAGE_BUCKETS if graphs else (), compiled)
        self.prefix_graphs = prefix_graphs(policy.prefix, device, buckets if graphs else (), compiled)
        if compiled:
            policy.expert.compile()
        body = lambda inputs, i: {"x": policy.expert.step(inputs["x"], inputs["prefix_kv"], inputs["prefix_valid"], i)}  # noqa: E731
        steps = policy.cfg.num_steps
        self.eager = LoopGraphs(body, steps, ("x",), device, buckets=(), name="eager")
        self.graph = LoopGraphs(body, steps, ("x",), device, buckets=buckets, name="graph")

    @torch.inference_mode()
    def vision(self, images, image_mask):
        cfg = self.policy.cfg
        return encode_present(self.vision_graphs, images, image_mask, cfg.vision.tokens, cfg.prefix.width, self.dtype,
                              images.device)

    def prefix(self, image_tokens, image_mask, tokens, token_mask):
        out = self.prefix_graphs.run({"image_tokens": image_tokens, "image_mask": image_mask, "tokens": tokens,
                                      "token_mask": token_mask})
        return out["prefix_kv"], out["prefix_valid"]

    def loop(self, loops: LoopGraphs, noise, kv, valid):
        return loops.run({"x": noise, "prefix_kv": kv, "prefix_valid": valid})["x"]

    def e2e(self, images, image_mask, tokens, token_mask, noise):
        kv, valid = self.prefix(self.vision(images, image_mask), image_mask, tokens, token_mask)
        return self.loop(self.graph, noise, kv, valid)


class Baseline:
    """The same inference written plainly with transformers modules (openpi's code path)."""

    def __init__(self, policy: Pi05, device: str, dtype: torch.dtype, compile_parts: bool):
        from transformers import GemmaConfig, GemmaModel, SiglipVisionConfig, SiglipVisionModel

        cfg = self.cfg = policy.cfg
        v, p, e = cfg.vision, cfg.prefix, cfg.expert
        self.dtype = dtype
        self.siglip = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=v.hidden, intermediate_size=v.mlp, num_hidden_layers=v.layers, num_attention_heads=v.heads,
            image_size=v.image_size, patch_size=v.patch, hidden_act="gelu_pytorch_tanh", layer_norm_eps=v.eps,
            vision_use_head=False, attn_implementation="sdpa"))
        prefix_key = "vision_model." if any(k.startswith("vision_model.") for k in self.siglip.state_dict()) else ""
        self.siglip.load_state_dict({prefix_key + k: t for k, t in policy.vision.vision.state_dict().items()})
        self.projector = torch.nn.Linear(v.hidden, p.width)
        self.projector.load_state_dict(policy.vision.projector.state_dict())

        def gemma(g, vocab):
            return GemmaModel(GemmaConfig(hidden_size=g.width, intermediate_size=g.mlp, num_attention_heads=g.heads,
                                          num_key_value_heads=g.kv_heads, head_dim=g.head_dim, rms_norm_eps=g.eps,
                                          num_hidden_layers=g.depth, vocab_size=vocab, hidden_activation="gelu_pytorch_tanh",
                                          attn_implementation="sdpa"))

        self.lm = gemma(p, cfg.vocab)
        self.lm.load_state_dict(policy.prefix.state_dict(), strict=False)  # its final norm is unused
        for layer in self.lm.layers:
            layer.self_attn.is_causal = False  # the prefix is bidirectional (all tokens valid here)
        self.expert = gemma(e, 8)
        self.expert.embed_tokens = None
        ours = policy.expert
        for mine, theirs in zip(ours.layers, self.expert.layers, strict=True):
            for name in ("self_attn", "mlp"):
                getattr(theirs, name).load_state_dict(getattr(mine, name).state_dict())
            # adaRMS patched in: a dense per norm (scale, shift, gate from the time condition)
            theirs.input_layernorm.dense = mine.input_layernorm.dense
            theirs.post_attention_layernorm.dense = mine.post_attention_layernorm.dense
        self.final_dense = ours.norm.dense
        self.heads = {n: getattr(ours, n) for n in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")}
        for m in (self.siglip, self.projector, self.lm, self.expert, self.final_dense):
            m.to(device=device, dtype=dtype).eval()
        for m in self.heads.values():
            m.to(device=device, dtype=torch.float32)
        self.vision_fn, self.prefix_fn, self.step_fn = self._vision, self._prefix, self._denoise
        self.compiled: dict[str, str] = {}
        if compile_parts:
            for name in ("vision_fn", "prefix_fn", "step_fn"):
                setattr(self, name, torch.compile(getattr(self, name), dynamic=False))
                self.compiled[name] = "torch.compile"

    def _vision(self, pixels):
        return self.projector(self.siglip(pixel_values=pixels).last_hidden_state)

    def _prefix(self, embeds):
        out = self.lm(inputs_embeds=embeds, use_cache=True)
        cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        return [kv_of(cache, i) for i in range(len(self.lm.layers))]

    @staticmethod
    def _adarms(x, dense, cond, eps):
        scale, shift, gate = dense(cond.to(dense.weight.dtype))[:, None].chunk(3, dim=-1)
        normed = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)

    def _denoise(self, x, t, kv, offset):
        from transformers.models.gemma.modeling_gemma import apply_rotary_pos_emb

        e, h = self.cfg.expert, self.heads
        emb = time_embedding(t, e.width, self.cfg.min_period, self.cfg.max_period)
        cond = F.silu(h["time_mlp_out"](F.silu(h["time_mlp_in"](emb))))
        hs = h["action_in_proj"](x).to(self.dtype)
        b, n = hs.shape[:2]
        pos = offset + torch.arange(n, device=x.device)[None].expand(b, n)
        cos, sin = self.expert.rotary_emb(hs, pos)
        for layer, (pk, pv) in zip(self.expert.layers, kv, strict=True):
            a = layer.self_attn
            normed, gate = self._adarms(hs, layer.input_layernorm.dense, cond, e.eps)
            q, k, v = (proj(normed).view(b, n, -1, e.head_dim).transpose(1, 2) for proj in (a.q_proj, a.k_proj, a.v_proj))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            o = F.scaled_dot_product_attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), enable_gqa=True)
            hs = hs + a.o_proj(o.transpose(1, 2).reshape(b, n, -1)) * gate
            normed, gate = self._adarms(hs, layer.post_attention_layernorm.dense, cond, e.eps)
            hs = hs + layer.mlp(normed) * gate
        normed, _ = self._adarms(hs, self.final_dense, cond, e.eps)
        return h["action_out_proj"](normed.float())

    @torch.inference_mode()
    def vision(self, images):
        b, c = images.shape[:2]
        pixels = pixels_from_uint8(images.flatten(0, 1), self.dtype)
        return self.vision_fn(pixels).view(b, -1, self.cfg.prefix.width)

    @torch.inference_mode()
    def prefix(self, image_tokens, tokens):
        text = self.lm.embed_tokens(tokens)  # transformers >= 5 scales by sqrt(width) inside the embedding
        return self.prefix_fn(torch.cat([image_tokens, text.to(image_tokens.dtype)], 1))

    @torch.inference_mode()
    def loop(self, noise, kv):
        x, dt = noise, -1.0 / self.cfg.num_steps
        t = torch.ones(noise.shape[0], dtype=torch.float32, device=noise.device)
        offset = kv[0][0].shape[2]
        for _ in range(self.cfg.num_steps):
            x = x + dt * self.step_fn(x, t, kv, offset)
            t = t + dt
        return x

    def e2e(self, images, tokens, noise):
        return self.loop(noise, self.prefix(self.vision(images), tokens))


def kv_of(cache, i: int):
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[i], cache.value_cache[i]
    return cache[i][0], cache[i][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="the baseline under torch.compile (auto: on CUDA)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--engine-graphs", choices=("on", "off"), default="on", help="vision and prefix as CUDA graphs")
    ap.add_argument("--engine-compile", choices=("on", "off"), default="on",
                    help="vision, prefix and expert step under torch.compile (the served default on CUDA)")
    ap.add_argument("--profile", metavar="DIR", help="also write each engine part's CUDA kernel table (torch.profiler, "
                    "first batch size) to DIR/<part>.txt")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    device = args.device
    dtype = torch.float32 if args.tiny or not device.startswith("cuda") else torch.bfloat16
    cfg = tiny_config() if args.tiny else Pi05Config(max_token_len=200)
    batches = [int(b) for b in args.batches.split(",")]
    reps, warmup = (3, 1) if args.tiny else (args.reps, args.warmup)
    torch.manual_seed(0)
    policy = random_policy(cfg, device, dtype, seed=0)
    engine = Engine(policy, device, dtype, buckets=tuple(batches), graphs=args.engine_graphs == "on",
                    compiled=args.engine_compile == "on" and device.startswith("cuda"))
    compile_parts = args.compile == "on" or (args.compile == "auto" and device.startswith("cuda"))
    baseline = None if args.no_baseline else Baseline(policy, device, dtype, compile_parts)
    result = {"device": torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "tiny": args.tiny, "reps": reps, "warmup": warmup,
              "cameras": len(cfg.cameras), "prompt_tokens": cfg.max_token_len, "steps": cfg.num_steps,
              "action_horizon": cfg.action_horizon, "engine_graphs": args.engine_graphs,
              "engine_compile": args.engine_compile if device.startswith("cuda") else "off", "baseline_compiled": baseline.compiled if baseline else None,
              "rows": []}
    for b in batches:
        images, image_mask, tokens, token_mask, noise = make_inputs(cfg, b, device)
        image_tokens = engine.vision(images, image_mask)
        kv, valid = engine.prefix(image_tokens, image_mask, tokens, token_mask)
        row = {"batch": b,
               "vision_ms": median_ms(lambda: engine.vision(images, image_mask), device, reps, warmup),  # noqa: B023
               "prefix_ms": median_ms(lambda: engine.prefix(image_tokens, image_mask, tokens, token_mask), device, reps, warmup),  # noqa: B023
               "loop_eager_ms": median_ms(lambda: engine.loop(engine.eager, noise, kv, valid), device, reps, warmup),  # noqa: B023
               "loop_graph_ms": median_ms(lambda: engine.loop(engine.graph, noise, kv, valid), device, reps, warmup),  # noqa: B023
               "e2e_ms": median_ms(lambda: engine.e2e(images, image_mask, tokens, token_mask, noise), device, reps, warmup)}  # noqa: B023
        row["loop_graph_replays"] = engine.graph.stats.graph_replays
        if args.profile and b == batches[0]:
            profile_parts(args.profile, {
                "vision": lambda: engine.vision(images, image_mask),  # noqa: B023
                "prefix": lambda: engine.prefix(image_tokens, image_mask, tokens, token_mask),  # noqa: B023
                "loop_graph": lambda: engine.loop(engine.graph, noise, kv, valid),  # noqa: B023
                "loop_eager": lambda: engine.loop(engine.eager, noise, kv, valid)}, device)  # noqa: B023
        row["chunks_per_s"] = b / row["e2e_ms"] * 1e3
        ours = engine.e2e(images, image_mask, tokens, token_mask, noise)
        if baseline is not None:
            bt = baseline.vision(images)
            bkv = baseline.prefix(bt, tokens)
            row |= {"baseline_vision_ms": median_ms(lambda: baseline.vision(images), device, reps, warmup),  # noqa: B023
                    "baseline_prefix_ms": median_ms(lambda: baseline.prefix(bt, tokens), device, reps, warmup),  # noqa: B023
                    "baseline_loop_ms": median_ms(lambda: baseline.loop(noise, bkv), device, reps, warmup),  # noqa: B023
                    "baseline_e2e_ms": median_ms(lambda: baseline.e2e(images, tokens, noise), device, reps, warmup)}  # noqa: B023
            row["speedup_e2e"] = row["baseline_e2e_ms"] / row["e2e_ms"]
            if args.profile and b == batches[0]:  # its kernel count says whether its compiled step ran
                profile_parts(args.profile, {"baseline_loop": lambda: baseline.loop(noise, bkv)}, device)  # noqa: B023
            row["actions_max_abs_diff"] = float((baseline.e2e(images, tokens, noise) - ours).abs().max())
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        result["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
