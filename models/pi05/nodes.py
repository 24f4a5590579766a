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
from mstar.models.pi05.policy import ActionExpert, PrefixLM, VisionTower, pixels_from_uint8
from mstar.models.pi05.weights import load_module
from mstar.services.engines.loop_graph import LoopGraphs

IMAGE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # present cameras in a batch
BATCH_BUCKETS = (1, 2, 4, 8, 16)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def node_dtype(ctx: NodeContext) -> torch.dtype:
    """``model_kwargs.dtype``: bfloat16 on a GPU, float32 on a CPU by default."""
    name = ctx.model_kwargs.get("dtype") or ("bfloat16" if ctx.device.startswith("cuda") else "float32")
    if name not in DTYPES:
        raise ValueError(f"model_kwargs.dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def vision_graphs(tower: VisionTower, device: str, buckets=IMAGE_BUCKETS, compiled: bool = False) -> LoopGraphs:
    """uint8 images [N, 3, S, S] -> image tokens [N, T, W]; one CUDA graph per bucket of N on a GPU
    (eager on a CPU), the tower under torch.compile inside it with ``compiled``."""
    dtype = tower.projector.weight.dtype
    fn = torch.compile(tower) if compiled else tower
    return LoopGraphs(lambda i, _: {"tokens": fn(pixels_from_uint8(i["images"], dtype))}, 1, (), device, buckets,
                      name="vit_encoder")


def prefix_graphs(lm: PrefixLM, device: str, buckets=BATCH_BUCKETS, compiled: bool = False) -> LoopGraphs:
    """The prefix of a batch (fixed length: every camera slot and the padded prompt) -> K / V and the
    valid mask; one CUDA graph per batch bucket on a GPU, the LM under torch.compile with ``compiled``."""
    fn = torch.compile(lm) if compiled else lm

    def body(i, _):
        kv, valid = fn(i["image_tokens"], i["image_mask"], i["tokens"], i["token_mask"])
        return {"prefix_kv": kv, "prefix_valid": valid}
    return LoopGraphs(body, 1, (), device, buckets, name="llm_prefix")


def prefix_length(cfg: Pi05Config) -> int:
    return len(cfg.cameras) * cfg.vision.tokens + cfg.max_token_len


def encode_present(graphs: LoopGraphs, images: torch.Tensor, image_mask: torch.Tensor, tokens: int,
                   width: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """[B, cameras, 3, S, S] uint8 and the mask -> [B, cameras * T, W] on ``device``: the present
    cameras of every request in one batch (``graphs``), zeros where a camera is missing. Given on
    the host (as a node gets them), only the present images are uploaded and nothing waits for
    the GPU: the rows are picked by index on the host."""
    b, c = image_mask.shape
    rows = image_mask.cpu().flatten().nonzero().squeeze(1)
    out = torch.zeros(b * c, tokens, width, dtype=dtype, device=device)
    if len(rows):
        present = images.flatten(0, 1)[rows.to(images.device)].to(device)
        out[rows.to(device)] = graphs.run({"images": present})["tokens"]
    return out.view(b, c * tokens, width)


def stack(calls: list[NodeCall], name: str, device: str | None = None) -> torch.Tensor:
    """The calls' ``name`` inputs on a new dim 0, moved to ``device`` (None: where they are)."""
    out = torch.stack([c.inputs[name] for c in calls])
    return out if device is None else out.to(device)


class VisionNode(NodeSubmodule):
    blocking = True
    max_batch = 16

    def __init__(self, cfg: Pi05Config, weights: Path, ctx: NodeContext):
        self.device, self.dtype, self.cfg = ctx.device, node_dtype(ctx), cfg
        self.tower = load_module(VisionTower, cfg, weights, ctx.device, self.dtype)
        self.graphs = vision_graphs(self.tower, ctx.device, compiled=ctx.compile)
        s = cfg.vision.image_size  # every bucket compiled and captured before serving
        self.graphs.warm({"images": torch.zeros(3, s, s, dtype=torch.uint8, device=ctx.device)})

    @torch.inference_mode()
    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        tokens = encode_present(self.graphs, stack(calls, "images"), stack(calls, "image_mask"),
                                self.cfg.vision.tokens, self.cfg.prefix.width, self.dtype, self.device)
        return [{"image_tokens": t} for t in tokens]


class PrefixNode(NodeSubmodule):
    blocking = True
    max_batch = 16

    def __init__(self, cfg: Pi05Config, weights: Path, ctx: NodeContext):
        self.device = ctx.device
        dtype = node_dtype(ctx)
        self.lm = load_module(PrefixLM, cfg, weights, ctx.device, dtype)
        self.graphs = prefix_graphs(self.lm, ctx.device, compiled=ctx.compile)
        cams, n, dev = len(cfg.cameras), cfg.max_token_len, ctx.device  # every bucket made before serving
        self.graphs.warm({"image_tokens": torch.zeros(cams * cfg.vision.tokens, cfg.prefix.width, dtype=dtype, device=dev),
                          "image_mask": torch.ones(cams, dtype=torch.bool, device=dev),
                          "tokens": torch.zeros(n, dtype=torch.long, device=dev),
                          "token_mask": torch.ones(n, dtype=torch.bool, device=dev)})

    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        out = self.graphs.run({n: stack(calls, n, self.device) for n in ("image_tokens", "image_mask", "tokens", "token_mask")})
        return [{k: v[i] for k, v in out.items()} for i in range(len(calls))]


class ActionNode(LoopBodyNode):
    graph_buckets = (1, 2, 4, 8, 16)

    def __init__(self, cfg: Pi05Config, weights: Path, ctx: NodeContext):
        self.device, self.cfg, self.dtype = ctx.device, cfg, node_dtype(ctx)
        self.expert = load_module(ActionExpert, cfg, weights, ctx.device, self.dtype)
        if ctx.compile:  # the step under torch.compile, inside the loop's CUDA graph
            self.expert.compile()

    def example_inputs(self) -> dict[str, torch.Tensor]:
        c, e, p = self.cfg, self.cfg.expert, prefix_length(self.cfg)
        return {"x": torch.zeros(c.action_horizon, c.action_dim, device=self.device),
                "prefix_kv": torch.zeros(e.depth, 2, e.kv_heads, p, e.head_dim, dtype=self.dtype, device=self.device),
                "prefix_valid": torch.ones(p, dtype=torch.bool, device=self.device)}

    def step(self, inputs: dict[str, torch.Tensor], iteration: int) -> dict[str, torch.Tensor]:
        x = self.expert.step(inputs["x"], inputs["prefix_kv"], inputs["prefix_valid"], iteration)
        return {"x": x, "actions": x}
