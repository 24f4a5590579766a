"""π0.5's graph nodes: each loads its part of the checkpoint and runs a batch of requests at a time.

- ``VisionNode`` (``vit_encoder``): the present cameras of every request in one SigLIP batch;
- ``PrefixNode`` (``llm_prefix``): the Gemma-2B prefix of a batch -> each request's K / V (a tensor
  value, persisted for the ``action_gen`` walk; never appended to);
- ``ActionNode`` (``action_expert``): a ``LoopBodyNode``, one Euler step per ``step``; the runtime runs
  all steps of a batch in one call (one CUDA graph replay per batch bucket on a GPU). The prefix K / V
  and mask are the loop's constants, ``x`` its carried value.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mstar.models.base import LoopBodyNode, NodeCall, NodeContext, NodeSubmodule
from mstar.models.pi05.config import Pi05Config
from mstar.models.pi05.policy import ActionExpert, PrefixLM, VisionTower, encode_cameras, pixels_from_uint8
from mstar.models.pi05.weights import load_module

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def node_dtype(ctx: NodeContext) -> torch.dtype:
    """``model_kwargs.dtype``: bfloat16 on a GPU, float32 on a CPU by default."""
    name = ctx.model_kwargs.get("dtype") or ("bfloat16" if ctx.device.startswith("cuda") else "float32")
    if name not in DTYPES:
        raise ValueError(f"model_kwargs.dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def stack(calls: list[NodeCall], name: str, device: str) -> torch.Tensor:
    return torch.stack([c.inputs[name] for c in calls]).to(device)


class VisionNode(NodeSubmodule):
    blocking = True
    max_batch = 16

    def __init__(self, cfg: Pi05Config, weights: Path, ctx: NodeContext):
        self.device, self.dtype = ctx.device, node_dtype(ctx)
        self.tower = load_module(VisionTower, cfg, weights, ctx.device, self.dtype)

    @torch.inference_mode()
    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        pixels = pixels_from_uint8(stack(calls, "images", self.device), self.dtype)
        tokens = encode_cameras(self.tower, pixels, stack(calls, "image_mask", self.device))
        return [{"image_tokens": t} for t in tokens]


class PrefixNode(NodeSubmodule):
    blocking = True
    max_batch = 16

    def __init__(self, cfg: Pi05Config, weights: Path, ctx: NodeContext):
        self.device = ctx.device
        self.lm = load_module(PrefixLM, cfg, weights, ctx.device, node_dtype(ctx))

    @torch.inference_mode()
    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        kv, valid = self.lm(*(stack(calls, n, self.device) for n in ("image_tokens", "image_mask", "tokens", "token_mask")))
        return [{"prefix_kv": kv[i], "prefix_valid": valid[i]} for i in range(len(calls))]


class ActionNode(LoopBodyNode):
    graph_buckets = (1, 2, 4, 8, 16)

    def __init__(self, cfg: Pi05Config, weights: Path, ctx: NodeContext):
        self.device = ctx.device
        self.expert = load_module(ActionExpert, cfg, weights, ctx.device, node_dtype(ctx))

    def step(self, inputs: dict[str, torch.Tensor], iteration: int) -> dict[str, torch.Tensor]:
        x = self.expert.step(inputs["x"], inputs["prefix_kv"], inputs["prefix_valid"], iteration)
        return {"x": x, "actions": x}
