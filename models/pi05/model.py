"""π0.5 (Physical Intelligence): a vision-language-action policy. Camera images, a task and the robot
state in; a chunk of ``action_horizon`` actions [horizon, 32] out.

Walks:
- ``prefill``: ``vit_encoder`` (SigLIP over the present cameras) -> ``llm_prefix`` (Gemma-2B over image
  tokens + prompt) -> the prefix K / V and mask, persisted for the next walk;
- ``action_gen``: a Loop of 10 Euler steps of ``action_expert`` (Gemma-300M with adaRMS attending over
  the prefix K / V) from noise at t = 1, dt = -0.1; a whole loop, one call per batch (one CUDA graph
  per batch bucket on a GPU). The last x leaves as ``actions``, un-normalised by ``postprocess``.

Request: ``text`` = the task, ``files`` = camera images named base_0_rgb / left_wrist_0_rgb /
right_wrist_0_rgb (a missing camera is masked), ``model_kwargs`` {"state": [floats], "seed": int}.
``Conductor.Act`` (typed: task, images, state, seed) is read as that request (conductor/act.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
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
from mstar.models.knobs import KnobError
from mstar.models.pi05.config import Pi05Config, config_from_json
from mstar.models.pi05.images import decode_image
from mstar.models.pi05.knobs import MAX_STATE_DIM, Pi05Request, Pi05Settings
from mstar.models.pi05.prompt import PromptTokenizer, discretize, pad_tokens, prompt_text
from mstar.models.pi05.stats import NormStats, load_norm_stats

DEFAULT_CHECKPOINT = "lerobot/pi05_base"
HELP = ("put the checkpoint (model.safetensors, config.json, the PaliGemma tokenizer.json or tokenizer.model, and "
        "its normalisation statistics) in --cache-dir (HF cache layout or <cache-dir>/org/name), or serve with "
        "--random-weights for a tiny random demo checkpoint")


class Pi05Model(Model):
    name = "pi05"
    config_schema = Pi05Settings
    request_schema = Pi05Request
    nodes = (GraphNode("vit_encoder"), GraphNode("llm_prefix"), GraphNode("action_expert"))
    heavy_prompt = True  # decodes and resizes up to 3 camera images (ms each)
    act_output = "actions"  # Conductor.Act returns it; its request is read as this model's (see the module doc)

    def build_walks(self) -> list[Walk]:
        steps = int(self.model_kwargs.get("num_steps", 10))
        return [
            Walk("prefill", Sequential("vit_encoder", "llm_prefix"), [
                GraphEdge(INPUT, "vit_encoder", "images"), GraphEdge(INPUT, "vit_encoder", "image_mask"),
                GraphEdge("vit_encoder", "llm_prefix", "image_tokens"), GraphEdge(INPUT, "llm_prefix", "image_mask"),
                GraphEdge(INPUT, "llm_prefix", "tokens"), GraphEdge(INPUT, "llm_prefix", "token_mask"),
                GraphEdge("llm_prefix", "action_expert", "prefix_kv", persist=True),
                GraphEdge("llm_prefix", "action_expert", "prefix_valid", persist=True),
            ]),
            Walk("action_gen", Loop("action_expert", max_iters=steps, name="flow"), [
                GraphEdge(INPUT, "action_expert", "x"), GraphEdge(INPUT, "action_expert", "prefix_kv"),
                GraphEdge(INPUT, "action_expert", "prefix_valid"),
                GraphEdge("action_expert", "action_expert", "x"),
                GraphEdge("action_expert", EMIT_TO_CLIENT, "actions", modality=Modality.ACTION, at_loop_end=True),
            ]),
        ]

    # -- assets --------------------------------------------------------------------------
    def checkpoint_dir(self):
        from mstar.models.hub import resolve_checkpoint

        return resolve_checkpoint(self.model_kwargs.get("checkpoint", DEFAULT_CHECKPOINT), cache_dir=self.cache_dir)

    def config(self) -> Pi05Config:
        from mstar.models.orpheus.checkpoint import read_json

        horizon = self.model_kwargs.get("action_horizon")
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or not 1 <= horizon <= 256):
            raise ValueError(f"model_kwargs.action_horizon must be an integer in [1, 256], got {horizon!r}")
        cfg = config_from_json(read_json(self.checkpoint_dir() / "config.json"), horizon)
        if cfg.num_steps != int(self.model_kwargs.get("num_steps", 10)):
            cfg = Pi05Config(**{**cfg.__dict__, "num_steps": int(self.model_kwargs.get("num_steps", 10))})
        return cfg

    def check_assets(self) -> None:
        from mstar.models.orpheus.checkpoint import CheckpointError

        try:
            d = self.checkpoint_dir()
            self.config()
            for f in ("model.safetensors",):
                if not (d / f).is_file():
                    raise CheckpointError(f"missing file {d / f}")
            PromptTokenizer(d)
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            raise MissingAssets(f"pi05: {e}; {HELP}") from None

    def write_random_weights(self, directory: str) -> list[str]:
        from pathlib import Path

        from mstar.models.pi05.demo import write_demo_checkpoint

        target = Path(directory) / self.model_kwargs.get("checkpoint", DEFAULT_CHECKPOINT)
        if (target / "config.json").exists():
            return []
        write_demo_checkpoint(target)
        return [str(target)]

    @property
    def max_prompt_chars(self) -> int:
        """Its prompt is cut to ``max_token_len`` tokens (as the references do): text far past that is
        refused unread."""
        cfg = getattr(self, "_cfg", None)
        return super().max_prompt_chars if cfg is None else cfg.max_token_len * self.chars_per_token_bound

    def prepare_conductor(self) -> None:
        d = self.checkpoint_dir()
        self._cfg = self.config()
        self._tokenizer = PromptTokenizer(d)
        self._stats: NormStats | None = load_norm_stats(d)

    # -- conductor side ------------------------------------------------------------------
    def validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        try:  # types, ranges and unknown keys; then what a type cannot say (finite numbers)
            Pi05Request.parse(kwargs, model=self.name, sep=": ")
        except KnobError as e:
            raise InvalidArgument(e.key, e.description) from None
        state = kwargs.get("state")
        if not isinstance(state, list) or not state or any(isinstance(v, bool) or not isinstance(v, int | float)
                                                           for v in state):
            raise InvalidArgument("model_kwargs.state", f"must be a non-empty list of numbers, got {state!r}")
        if not all(np.isfinite(state)) or len(state) > MAX_STATE_DIM:
            raise InvalidArgument("model_kwargs.state", f"must hold at most {MAX_STATE_DIM} finite numbers")
        seed = kwargs.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise InvalidArgument("model_kwargs.seed", f"must be an integer in [0, 2**63), got {seed!r}")
        return {"state": [float(v) for v in state], "seed": seed}

    def _ensure_conductor(self) -> None:
        if not hasattr(self, "_tokenizer"):
            self.prepare_conductor()

    def camera_inputs(self, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 [cameras, 3, S, S], present [cameras]) from the request's files."""
        cams, size = self._cfg.cameras, self._cfg.vision.image_size
        if not prompt.files:
            raise InvalidArgument("files", f"no camera image; name images {', '.join(cams)}")
        if len(prompt.files) > len(cams):
            raise InvalidArgument("files", f"{len(prompt.files)} images, at most {len(cams)} cameras ({', '.join(cams)})")
        images = torch.zeros(len(cams), 3, size, size, dtype=torch.uint8)
        present = torch.zeros(len(cams), dtype=torch.bool)
        for i, f in enumerate(prompt.files):
            if f.name not in cams:
                raise InvalidArgument(f"files[{i}].name", f"unknown camera {f.name!r}; known: {', '.join(cams)}")
            c = cams.index(f.name)
            if present[c]:
                raise InvalidArgument(f"files[{i}].name", f"camera {f.name!r} given twice")
            try:
                images[c] = decode_image(f.data, size)
            except ValueError as e:
                raise InvalidArgument(f"files[{i}].data", f"camera {f.name!r}: {e}") from None
            present[c] = True
        return images, present

    def state_bins(self, state: list[float]) -> np.ndarray:
        norm = self._stats.state if self._stats is not None else None
        x = np.asarray(state, np.float64)
        if norm is not None:
            if len(state) != norm.dim:
                raise InvalidArgument("model_kwargs.state", f"has {len(state)} values; this robot's state has {norm.dim}")
            x = norm.normalize(x)
        return discretize(x)

    def process_prompt(self, prompt: Prompt) -> RequestState:
        self._ensure_conductor()
        images, present = self.camera_inputs(prompt)
        text = prompt_text(prompt.text, self.state_bins(prompt.kwargs["state"]))
        tokens, mask = pad_tokens(self._tokenizer.encode(text), self._cfg.max_token_len)
        state = RequestState(prompt, prompt_tokens=int(mask.sum()))
        state.data["prefill"] = {"images": images, "image_mask": present, "tokens": tokens, "token_mask": mask}
        return state

    def noise(self, seed: int | None) -> torch.Tensor:
        g = torch.Generator()
        g.manual_seed(seed) if seed is not None else g.seed()
        return torch.randn(self._cfg.action_horizon, self._cfg.action_dim, generator=g)

    def next_walk(self, state: RequestState, finished: str | None) -> WalkSeed | None:
        if finished is None:
            return WalkSeed("prefill", state.data["prefill"])
        if finished == "prefill":
            return WalkSeed("action_gen", {"x": self.noise(state.prompt.kwargs.get("seed"))})
        return None

    def unnormalize(self, actions: torch.Tensor) -> torch.Tensor:
        """[horizon, 32] -> the first ``dim`` columns in the robot's units (the rest as the model gave them)."""
        norm = self._stats.action if self._stats is not None else None
        out = actions.float().cpu().clone()
        if norm is not None:
            d = min(norm.dim, out.shape[-1])
            out[:, :d] = torch.from_numpy(norm.unnormalize(out[:, :d].double().numpy())[..., :d]).float()
        return out

    def postprocess(self, state: RequestState, emit: Emit) -> list[Output]:
        self._ensure_conductor()
        state.completion_tokens = self._cfg.action_horizon
        return [Output("actions", Modality.ACTION, tensor=self.unnormalize(emit.tensor))]

    # -- node-group side -----------------------------------------------------------------
    def create_submodule(self, ctx: NodeContext) -> NodeSubmodule:
        from mstar.models.pi05.nodes import ActionNode, PrefixNode, VisionNode

        cls = {"vit_encoder": VisionNode, "llm_prefix": PrefixNode, "action_expert": ActionNode}[ctx.node]
        return cls(self.config(), self.checkpoint_dir() / "model.safetensors", ctx)
