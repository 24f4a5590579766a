"""A Llama-architecture decoder on the paged KV cache, loadable from a Hugging Face
Llama checkpoint directory (config.json + *.safetensors; q/k/v and gate/up are fused into one
GEMM each as they load)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.services.engines.attention import HeadShape
from mstar.services.engines.kv_cache import KVCacheSpec
from mstar.services.engines.layers import (
    DecoderLayer,
    ForwardContext,
    GatedMLP,
    PagedAttention,
    RMSNorm,
    RopeScaling,
    RotaryEmbedding,
    fold_norm_weights,
    fused_norms_unavailable_reason,
    set_weight_layout,
)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 131072  # rows of the fused RoPE kernels' cos/sin table

    def __post_init__(self) -> None:
        HeadShape(self.num_heads, self.num_kv_heads, self.head_dim)  # validates GQA grouping

    @property
    def heads(self) -> HeadShape:
        return HeadShape(self.num_heads, self.num_kv_heads, self.head_dim)

    def shard(self, size: int) -> LlamaConfig:
        """One tensor-parallel rank's view: its heads and MLP rows (hidden size and vocab stay)."""
        for what, n in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                        ("intermediate_size", self.intermediate_size)):
            if n % size:
                raise ValueError(f"{what}={n} does not split over tp_size={size}")
        return replace(self, num_heads=self.num_heads // size, num_kv_heads=self.num_kv_heads // size,
                       intermediate_size=self.intermediate_size // size)

    def kv_spec(self, page_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, page_size, dtype)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> LlamaConfig:
        """From a Hugging Face Llama config (transformers 4.x ``rope_scaling`` + ``rope_theta``
        or 5.x ``rope_parameters``)."""
        try:
            heads = cfg["num_attention_heads"]
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type == "llama3":
                scaling = RopeScaling(
                    float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                    int(rope["original_max_position_embeddings"]),
                )
            elif rope_type == "default":
                scaling = None
            else:
                raise ValueError(f"{source}: rope type '{rope_type}' is not supported. Known: default, llama3")
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
                rope_theta=float(theta),
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                max_position_embeddings=int(cfg.get("max_position_embeddings") or 131072),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing key {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> LlamaConfig:
        f = Path(path) / "config.json"
        return cls.from_hf(json.loads(f.read_text()), str(f))


class LlamaBackbone(nn.Module):
    """Embeddings -> decoder layers -> final norm (HF's ``model.`` subtree)."""

    def __init__(self, cfg: LlamaConfig, tp=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(
            DecoderLayer(
                PagedAttention(i, cfg.hidden_size, cfg.heads, rope, cfg.attention_bias, cfg.attention_bias, tp),
                GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp),
                cfg.hidden_size,
                cfg.rms_norm_eps,
            )
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.fused_norms:
            h = embeds.clone()  # the residual stream, updated in place by every layer
            for layer in self.layers:
                layer.forward_fused_norms(h, positions, ctx)
            return ctx.ops.rms_norm(h, self.norm.weight, self.norm.eps)
        h, residual = embeds, None
        for layer in self.layers:
            h, residual = layer(h, positions, ctx, residual)
        if residual is None:  # no layers
            return ctx.ops.rms_norm(h, self.norm.weight, self.norm.eps)
        return ctx.ops.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]


class LlamaForCausalLM(nn.Module):
    """The backbone plus an LM head. ``forward`` maps token ids or input embeddings
    ([num_tokens] / [num_tokens, hidden], sequences concatenated) to final hidden states.

    With ``tp`` (a ``TensorParallel`` rank), ``cfg`` is the rank's shard (``LlamaConfig.shard``)."""

    norms_folded = False  # fold_norms() ran

    def __init__(self, cfg: LlamaConfig, tp=None):
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # Several rows by advanced indexing, not nn.Embedding's index_select: on CUDA that takes
        # a small-index kernel for 2-16 ids. H100, 3,072-wide bf16 rows, µs per lookup (index_select
        # / indexing): 1 id 2.2 / 3.1, 8 ids 4.8 / 1.8, 16 ids 7.9 / 1.8, 64 ids 2.1 / 2.0
        # (bench/results/engines/2026-11-25/step_trace.json -> embed). Same rows either way.
        if token_ids.numel() == 1:
            return self.model.embed_tokens(token_ids)
        return self.model.embed_tokens.weight[token_ids]

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(embeds, positions, ctx)

    def fold_norms(self) -> None:
        """Fold every layer's two RMSNorm weights into its qkv / gate_up projections (outputs
        unchanged up to rounding), which lets decode steps skip the norm kernels
        (``ForwardContext.fused_norms``). ``from_pretrained`` does this on CUDA; idempotent."""
        if not self.norms_folded:
            for layer in self.model.layers:
                fold_norm_weights(layer)
            self.norms_folded = True

    def fused_norms_unavailable_reason(self) -> str | None:
        """Why forwards cannot take ``ctx.fused_norms`` (None: they can)."""
        return next((r for layer in self.model.layers
                     if (r := fused_norms_unavailable_reason(layer, self.norms_folded))), None)

    def compute_logits(self, hidden: torch.Tensor, vocab_ranges: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        """Logits over the whole vocabulary, or only over ``vocab_ranges`` (half-open id
        ranges; columns in their order): the head reads only those rows of its weight."""
        if not vocab_ranges:
            return self.lm_head(hidden)
        w = self.lm_head.weight
        return torch.cat([F.linear(hidden, w[a:b]) for a, b in vocab_ranges], dim=-1)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu", tp=None) -> LlamaForCausalLM:
        """``tp``: this process's ``TensorParallel`` rank (loads its shard of the weights)."""
        from mstar.services.engines.weights import load_checkpoint

        cfg = LlamaConfig.from_dir(path)
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        if size > 1:
            cfg = cfg.shard(size)
        with torch.device("meta"):
            model = cls(cfg, tp)
        model = model.to_empty(device=device).to(dtype)  # RotaryEmbedding refills its fp32 inv_freq
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        load_checkpoint(model, path, tp_rank=rank, tp_size=size)
        if torch.device(device).type == "cuda":
            set_weight_layout(model, column_major=True)
            model.fold_norms()
        return model.requires_grad_(False).eval()
