"""V-JEPA 2 and V-JEPA 2-AC served as a graph.

Nodes: ``video_encoder`` (stateless, batched), ``predictor`` (masked), ``ac_predictor``. Walks:
- ``encode``: a clip -> its latents;
- ``predict``: a clip -> the masked predictor's latents at ``target_ids``;
- ``rollout``: context frames, states, actions -> a Loop over steps, one predicted frame and pose
  per iteration on the request's K/V cache, all of them at the loop's end;
- ``rollout_streaming``: the same, each frame and pose emitted as it is made;
- ``plan``: a context frame, its pose and a goal image -> a Loop of CEM iterations, each a batched
  rollout over all samples; the mean trajectory at the end.

Two checkpoints per deployment (``model_kwargs``): ``checkpoint`` (V-JEPA 2: encoder + masked
predictor, Hugging Face or ``.pt`` layout) for encode / predict, ``ac_checkpoint`` (V-JEPA 2-AC:
encoder + AC predictor, ``.pt``) for rollout / plan; either may be null.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mstar.models.base import (
    Emit,
    InvalidArgument,
    MissingAssets,
    Model,
    NodeContext,
    NodeSubmodule,
    Output,
    Prompt,
    RequestState,
    WalkSeed,
)
from mstar.models.graph import EMIT_TO_CLIENT, INPUT, GraphEdge, GraphNode, Loop, Modality, Sequential, Walk
from mstar.models.vjepa2 import cem, media, requests, weights
from mstar.models.vjepa2.config import VJepa2Config
from mstar.models.vjepa2.knobs import VJepa2Request, VJepa2Settings

DEFAULT_CHECKPOINT = "facebook/vjepa2-vitl-fpc64-256"
DEFAULT_AC_CHECKPOINT = "facebook/vjepa2-ac-vitg"  # a directory holding vjepa2-ac-vitg.pt
MAX_STEPS = 31  # predicted frames of a rollout (the reference's mask covers 32 frames)
HELP = ("put the checkpoints in --cache-dir (HF cache layout, or <cache-dir>/org/name; the AC one a directory "
        "holding the official .pt), set model_kwargs.checkpoint / ac_checkpoint, or serve with --random-weights")


def _emit(src: str, name: str, modality=Modality.LATENT, **kw) -> GraphEdge:
    return GraphEdge(src, EMIT_TO_CLIENT, name, modality=modality, **kw)


class VJepa2Model(Model):
    name = "vjepa2"
    config_schema = VJepa2Settings
    request_schema = VJepa2Request
    nodes = (GraphNode("video_encoder"), GraphNode("predictor"), GraphNode("ac_predictor"))
    heavy_prompt = True  # decodes video (~0.1 s for 16 frames of 342x256 mp4 on a 2-core VM)

    def build_walks(self) -> list[Walk]:
        def ac_loop(walk: str, emits: list[GraphEdge], accumulate=frozenset()) -> Walk:
            return Walk(walk, Sequential("video_encoder", Loop("ac_predictor", MAX_STEPS, stop_node="ac_predictor",
                                                               accumulate=accumulate, name="steps")), [
                GraphEdge(INPUT, "video_encoder", "frames"),
                GraphEdge("video_encoder", "ac_predictor", "context", once=True),
                GraphEdge(INPUT, "ac_predictor", "actions"), GraphEdge(INPUT, "ac_predictor", "states"), *emits])

        return [
            Walk("encode", "video_encoder", [GraphEdge(INPUT, "video_encoder", "pixels"), _emit("video_encoder", "latents")]),
            Walk("predict", Sequential("video_encoder", "predictor"), [
                GraphEdge(INPUT, "video_encoder", "pixels"), GraphEdge("video_encoder", "predictor", "latents"),
                *(GraphEdge(INPUT, "predictor", n) for n in ("context_ids", "target_ids", "grid")),
                _emit("predictor", "predicted")]),
            ac_loop("rollout", [_emit("ac_predictor", n, at_loop_end=True) for n in ("frames", "poses")],
                    frozenset({"frames", "poses"})),
            ac_loop("rollout_streaming", [_emit("ac_predictor", n) for n in ("frames", "poses")]),
            Walk("plan", Sequential("video_encoder", Loop("ac_predictor", requests.MAX_CEM_STEPS, stop_node="ac_predictor",
                                                          name="cem")), [
                GraphEdge(INPUT, "video_encoder", "frames"), GraphEdge(INPUT, "video_encoder", "goal"),
                GraphEdge("video_encoder", "ac_predictor", "context", once=True),
                GraphEdge("video_encoder", "ac_predictor", "goal_latent"),
                GraphEdge(INPUT, "ac_predictor", "state"),
                GraphEdge(INPUT, "ac_predictor", "mean"), GraphEdge(INPUT, "ac_predictor", "std"),
                GraphEdge("ac_predictor", "ac_predictor", "mean"), GraphEdge("ac_predictor", "ac_predictor", "std"),
                _emit("ac_predictor", "action", Modality.ACTION, at_loop_end=True),
                _emit("ac_predictor", "energies", at_loop_end=True)]),
        ]

    # -- assets ------------------------------------------------------------------------------
    def checkpoint_names(self) -> dict[str, str | None]:
        """The two checkpoints by model_kwargs key. (Not ``Model.checkpoints``: the launcher reads that
        one as hub ``CheckpointSpec``s; V-JEPA 2 finds its own in check_assets, the AC one a .pt file.)"""
        kw = self.model_kwargs
        return {"checkpoint": kw.get("checkpoint", DEFAULT_CHECKPOINT),
                "ac_checkpoint": kw.get("ac_checkpoint", DEFAULT_AC_CHECKPOINT)}

    def configs(self) -> dict[str, VJepa2Config | None]:
        if not hasattr(self, "_configs"):
            try:
                self._configs = {k: weights.read(weights.resolve(v, self.cache_dir)).config if v else None
                                 for k, v in self.checkpoint_names().items()}
            except weights.CheckpointError as e:
                raise MissingAssets(f"vjepa2: {e}; {HELP}") from None
        return self._configs

    def check_assets(self) -> None:
        self.configs()

    def prepare_conductor(self) -> None:
        self.configs()

    def write_random_weights(self, directory: str) -> list[str]:
        from mstar.models.vjepa2.config import ACConfig, EncoderConfig, PredictorConfig

        enc = EncoderConfig(dim=64, depth=2, heads=4, mlp_dim=128, patch=8, crop=32, frames=16)
        written = []
        ckpt = self.checkpoint_names()
        if ckpt["checkpoint"]:
            d = Path(directory) / ckpt["checkpoint"]
            if not (d / "config.json").exists():
                cfg = VJepa2Config(enc, PredictorConfig(dim=48, depth=2, heads=4, mlp_dim=96, num_mask_tokens=2))
                weights.write_random(d, cfg, "hf", seed=0)
                written.append(str(d))
        if ckpt["ac_checkpoint"]:
            d = Path(directory) / ckpt["ac_checkpoint"]
            if not d.exists():
                cfg = VJepa2Config(enc, None, ACConfig(dim=64, depth=2, heads=4, mlp_dim=256))
                weights.write_random(d / "vjepa2-ac-random.pt", cfg, "pt", seed=2)
                written.append(str(d))
        return written

    # -- conductor side ------------------------------------------------------------------------
    def validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        out = requests.validate(kwargs)
        key = "checkpoint" if out["task"] in ("encode", "predict") else "ac_checkpoint"
        cfg = self.configs()[key]
        if cfg is None or (out["task"] == "predict" and cfg.predictor is None):
            raise InvalidArgument("model_kwargs.task", f"task {out['task']!r} is not served here: the deployment's "
                                                       f"{key} is not set or has no such predictor")
        return out

    def process_prompt(self, prompt: Prompt) -> RequestState:
        kw, task = prompt.kwargs, prompt.kwargs["task"]
        state = RequestState(prompt)
        if not prompt.files:
            raise InvalidArgument("files", f"task {task!r} needs a video or frames in files[0]")
        step = kw.get("frame_step", 1)
        if task in ("encode", "predict"):
            state.data["seed"] = WalkSeed(task, self._clip_inputs(prompt, step))
            return state
        cfg = self.configs()["ac_checkpoint"]
        assert cfg is not None and cfg.ac is not None
        crop = cfg.encoder.crop
        frames = media.load_frames(prompt.files[0], "files[0]", crop, crop, step, media.Limits(max_frames=cfg.ac.max_frames))
        T = frames.shape[0]
        states = torch.tensor(kw.get("states") or [], dtype=torch.float32)
        if task == "plan":
            if len(prompt.files) != 2:
                raise InvalidArgument("files", "plan takes the context frame (files[0]) and the goal image (files[1])")
            if T != 1:
                raise InvalidArgument("files[0]", f"plan starts from one context frame, got {T}")
            if states.shape[0] != 1:
                raise InvalidArgument("model_kwargs.states", "plan needs the context frame's pose: one row of 7 numbers")
            goal = media.load_frames(prompt.files[1], "files[1]", crop, crop, 1, media.Limits(max_frames=1))
            mean, std = cem.initial(cem.CEMConfig(**{k: kw[k] for k in cem.CEMConfig.knobs() if k in kw}))
            state.data["seed"] = WalkSeed("plan", {"frames": frames, "goal": goal, "state": states, "mean": mean, "std": std})
            return state
        actions = torch.tensor(kw.get("actions") or [], dtype=torch.float32)
        if states.shape[0] != T:
            raise InvalidArgument("model_kwargs.states", f"needs one pose per context frame: {T} rows, got {states.shape[0]}")
        steps = actions.shape[0] - (T - 1)
        if steps < 1:
            raise InvalidArgument("model_kwargs.actions", f"needs the {T - 1} actions between the context frames and one "
                                                          f"per step to predict: at least {T} rows, got {actions.shape[0]}")
        if T + steps > cfg.ac.max_frames or steps > MAX_STEPS:
            raise InvalidArgument("model_kwargs.actions", f"{T} context frames + {steps} steps exceed the predictor's "
                                                          f"{cfg.ac.max_frames} frames")
        walk = "rollout_streaming" if kw.get("stream") else "rollout"
        state.data["seed"] = WalkSeed(walk, {"frames": frames, "actions": actions, "states": states})
        return state

    def _clip_inputs(self, prompt: Prompt, step: int) -> dict[str, torch.Tensor]:
        cfg = self.configs()["checkpoint"]
        assert cfg is not None
        e = cfg.encoder
        pixels = media.load_frames(prompt.files[0], "files[0]", e.crop, int(e.crop * 256 / 224), step,
                                   media.Limits(max_frames=e.frames))
        T = pixels.shape[0]
        if T > 1 and T % e.tubelet:
            raise InvalidArgument("files[0]", f"{T} frames; the encoder takes tubelets of {e.tubelet} frames: send a "
                                              f"multiple of {e.tubelet} (or one image)")
        inputs = {"pixels": pixels}
        if prompt.kwargs["task"] == "predict":
            n = max(1, T // e.tubelet) * e.tokens_per_tubelet
            kw = prompt.kwargs
            target = kw.get("target_ids", list(range(n)))
            context = kw.get("context_ids") or ([i for i in range(n) if i not in set(target)] if "target_ids" in kw else target)
            for key, got in (("target_ids", target), ("context_ids", context)):
                if max(got, default=0) >= n or not got:
                    raise InvalidArgument(f"model_kwargs.{key}", f"token indices must be in [0, {n}) and not empty")
            inputs.update(context_ids=torch.tensor(context), target_ids=torch.tensor(target),
                          grid=torch.tensor([e.grid, e.grid]))
        return inputs

    def next_walk(self, state: RequestState, finished: str | None) -> WalkSeed | None:
        return state.data["seed"] if finished is None else None

    def postprocess(self, state: RequestState, emit: Emit) -> list[Output]:
        t = emit.tensor
        if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
            t = t.float()  # clients get fp32 latents
        modality = Modality.ACTION if emit.name == "action" else Modality.LATENT
        return [Output(emit.name, modality, tensor=t)]

    # -- node-group side -----------------------------------------------------------------------
    def create_submodule(self, ctx: NodeContext) -> NodeSubmodule:
        import dataclasses

        from mstar.models.vjepa2 import nodes

        ctx = dataclasses.replace(ctx, cache_dir=ctx.cache_dir or self.cache_dir)
        ck = self.checkpoint_names()
        if ctx.node == "video_encoder":
            return nodes.VideoEncoderNode(ctx, ck["checkpoint"], ck["ac_checkpoint"])
        if ctx.node == "predictor":
            return nodes.PredictorNode(ctx, ck["checkpoint"])
        return nodes.ACPredictorNode(ctx, ck["ac_checkpoint"])
