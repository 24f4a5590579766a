"""The node-side code: ``video_encoder``, ``predictor`` (masked) and ``ac_predictor``.

``video_encoder`` is stateless and batches every call of a round into one forward per (encoder,
frame shape). ``ac_predictor`` keeps each request's rollout (its K/V cache, the frame and pose
the next step feeds, all on the device) in the call's node state until the request is released;
in walk ``plan`` each loop iteration is one CEM iteration whose rollouts over all samples run as
one fixed-count loop (``LoopGraphs``: a CUDA graph per sample count on a GPU).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mstar.models.base import NodeCall, NodeContext, NodeSubmodule
from mstar.models.vjepa2 import cem, media, rollout, weights
from mstar.models.vjepa2.modules import (
    ACPredictor,
    Encoder,
    MaskedPredictor,
    attention_kernel,
    compile_blocks,
    warm_compiled,
)

log = logging.getLogger(__name__)

CLIP_WALKS = ("encode", "predict")  # the V-JEPA 2 encoder on clips (tubelets of 2 frames)
AC_WALKS = ("rollout", "rollout_streaming", "plan")  # the AC model's encoder on single frames


def dtype_of(kwargs: dict[str, Any], device: str) -> torch.dtype:
    name = kwargs.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


class Weights:
    """Both checkpoints of a deployment, loaded once per process (the nodes of a group share them)."""

    _cache: dict[tuple, tuple] = {}

    @classmethod
    def get(cls, name: str | None, ctx: NodeContext) -> tuple[Encoder | None, MaskedPredictor | None, ACPredictor | None]:
        if not name:
            return None, None, None
        key = (name, ctx.cache_dir, ctx.device, str(dtype_of(ctx.model_kwargs, ctx.device)))
        if key not in cls._cache:
            path = weights.resolve(name, ctx.cache_dir)
            mods = cls._cache[key] = weights.build(weights.read(path), ctx.device, dtype_of(ctx.model_kwargs, ctx.device))
            if mods[0] is not None:
                mods[0].attend = attention_kernel(ctx.model_kwargs.get("attention"))
            if ctx.compile:  # the blocks' halves: Triton's RoPE kernel, torch.compile; compiled now
                for m in mods:
                    if m is not None:
                        compile_blocks(m)
                warm_compiled(*mods)
            log.info("vjepa2: loaded %s on %s", path, ctx.device)
        return cls._cache[key]


class VideoEncoderNode(NodeSubmodule):
    blocking = True
    max_batch = 16

    def __init__(self, ctx: NodeContext, checkpoint: str | None, ac_checkpoint: str | None):
        self.clip_encoder = Weights.get(checkpoint, ctx)[0] if set(CLIP_WALKS) & set(ctx.walks or CLIP_WALKS) else None
        self.ac_encoder = Weights.get(ac_checkpoint, ctx)[0] if set(AC_WALKS) & set(ctx.walks or AC_WALKS) else None
        self.device = ctx.device

    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        out: list[dict[str, torch.Tensor]] = [{} for _ in calls]
        groups: dict[tuple, list[tuple[int, str, torch.Tensor]]] = {}
        for i, c in enumerate(calls):
            clip = c.walk in CLIP_WALKS
            for name in ("pixels",) if clip else ("frames", "goal"):
                if name in c.inputs:
                    x = c.inputs[name]
                    groups.setdefault((clip, tuple(x.shape[1:]), x.dtype), []).append((i, name, x))
        for (clip, _, _), items in groups.items():
            enc = self.clip_encoder if clip else self.ac_encoder
            assert enc is not None, "the conductor admits no walk whose checkpoint is not served"
            dtype = enc.norm.weight.dtype
            frames = [media.normalize(x, self.device, dtype) for _, _, x in items]
            with torch.inference_mode():
                if clip:  # [B, C, T, H, W]: each call one clip
                    tokens = enc(torch.stack(frames).transpose(1, 2))
                    parts = list(tokens)
                else:  # every frame alone, doubled into one tubelet; layer-normed without affine
                    tokens = rollout.normalize(enc(torch.cat(frames).unsqueeze(2)))
                    parts = list(tokens.split([f.shape[0] for f in frames]))
            for (i, name, _), t in zip(items, parts, strict=True):
                if clip:
                    out[i]["latents"] = t
                elif name == "goal":
                    out[i]["goal_latent"] = t[0]
                else:
                    out[i]["context"] = t
        return out


class PredictorNode(NodeSubmodule):
    blocking = True
    max_batch = 16

    def __init__(self, ctx: NodeContext, checkpoint: str | None):
        self.predictor = Weights.get(checkpoint, ctx)[1]

    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        assert self.predictor is not None, "the conductor admits no predict walk without a masked predictor"
        out = []
        for c in calls:  # sizes differ per request (its own context / target split)
            lat, ctx_ids, tgt_ids = c.inputs["latents"], c.inputs["context_ids"], c.inputs["target_ids"]
            dev = lat.device
            with torch.inference_mode():
                ctx_ids, tgt_ids = ctx_ids.to(dev), tgt_ids.to(dev)
                grid = tuple(int(v) for v in c.inputs["grid"])
                pred = self.predictor(lat[ctx_ids].unsqueeze(0), ctx_ids[None], tgt_ids[None], grid=grid)  # type: ignore[arg-type]
            out.append({"predicted": pred[0]})
        return out


class ACPredictorNode(NodeSubmodule):
    blocking = True
    max_batch = 32

    def __init__(self, ctx: NodeContext, ac_checkpoint: str | None):
        self.ac = Weights.get(ac_checkpoint, ctx)[2]
        self.device = ctx.device
        self.cuda_graphs = bool(ctx.model_kwargs.get("cuda_graphs", True)) and ctx.device.startswith("cuda")
        self.max_rows = int(ctx.model_kwargs.get("max_rollout_rows", 512))
        self._loops: dict[tuple[int, int], Any] = {}

    # -- rollout / rollout_streaming: one predicted frame per loop iteration ----------------
    def _rollout_steps(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        """One step of every call's rollout, batched: each request at its own frame."""
        assert self.ac is not None
        rs, acts = [], []
        for c in calls:
            a = c.inputs["actions"].to(self.device).unsqueeze(0)
            r = c.state.get("rollout")
            if r is None:  # the request's first iteration: its context frames into a new cache
                context = c.inputs["context"].unsqueeze(0)
                T = context.shape[1]
                states = c.inputs["states"].to(self.device).unsqueeze(0)
                r = c.state["rollout"] = rollout.start(self.ac, context, a, states, a.shape[1] - (T - 1))
            rs.append(r)
            acts.append(a[:, r.t])
        return [{"frames": f, "poses": p} for f, p in rollout.advance_many(self.ac, rs, acts)]

    # -- plan: one CEM iteration per loop iteration ----------------------------------------------
    def _world_model(self, context: torch.Tensor, state: torch.Tensor, steps: int):
        from mstar.services.engines.loop_graph import LoopGraphs

        def run(actions: torch.Tensor) -> torch.Tensor:
            finals = []
            for a in actions.split(self.max_rows):
                rows = a.shape[0]
                key = (steps, rows)
                if key not in self._loops:
                    self._loops[key] = LoopGraphs(rollout.RolloutBody(self.ac, steps), steps, ("frame", "pose"),
                                                  self.device, buckets=(rows,) if self.cuda_graphs else (), name="cem")
                out = self._loops[key].run({"frame": context.expand(rows, -1, -1), "pose": state.expand(rows, -1),
                                            "actions": a})
                finals.append(out["frame"])
            return torch.cat(finals)
        return run

    def _cem_step(self, c: NodeCall) -> dict[str, torch.Tensor]:
        cfg = cem.CEMConfig(**{k: c.kwargs[k] for k in cem.CEMConfig.knobs() if k in c.kwargs})
        g = c.state.get("generator")
        if g is None:
            g = c.state["generator"] = torch.Generator().manual_seed(int(c.kwargs.get("seed", 0)))
            c.state["context"] = c.inputs["context"][:1].to(self.device)
        mean, std = c.inputs["mean"].to(self.device), c.inputs["std"].to(self.device)
        noise = torch.randn((cfg.rollout, cfg.samples, 4), generator=g).to(self.device)
        actions = cem.sample(cfg, mean, std, noise)
        context = c.state["context"]
        state = c.inputs["state"].to(device=self.device, dtype=torch.float32)
        with torch.inference_mode():
            final = self._world_model(context, state, cfg.rollout)(actions)
            energies = cem.energy(final.float(), c.inputs["goal_latent"].float())
        mean, std, top = cem.update(cfg, mean, std, actions, energies)
        return {"mean": mean, "std": std, "action": cem.final_action(mean), "energies": energies[top]}

    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        assert self.ac is not None, "the conductor admits no AC walk without an AC checkpoint"
        with torch.inference_mode():
            if calls[0].walk == "plan":  # a batch is one walk's calls
                return [self._cem_step(c) for c in calls]
            return self._rollout_steps(calls)

    def check_stop(self, call: NodeCall, outputs: dict[str, torch.Tensor]) -> bool:
        if call.walk == "plan":
            return call.iteration + 1 >= call.kwargs.get("cem_steps", cem.CEMConfig.cem_steps)
        r = call.state["rollout"]
        return r.t >= r.cache.frames  # every action fed
