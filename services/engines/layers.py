"""Decoder building blocks shared by every model that runs on the paged KV cache:
RMSNorm, rotary embeddings (incl. Llama-3 frequency scaling), SwiGLU MLP, paged GQA
attention, and a pre-norm decoder layer. Parameter names follow Hugging Face's Llama
(``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ...), so HF checkpoints load
by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from mstar.services.engines.attention import AttentionBackend, HeadShape
from torch import nn


@dataclass(frozen=True)
class ForwardContext:
    """What attention layers need for one forward pass over the paged cache."""

    backend: AttentionBackend
    kv: torch.Tensor  # [layer, k|v, page, slot, kv_head, dim] (PagedKVCache.kv)
    slots: torch.Tensor  # int64 [num_tokens]: cache slot of each new token's K/V


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 ("llama3") frequency scaling; ``factor`` 1 with no bands means none."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    s = scaling
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        self._params = (head_dim, theta, scaling)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def _apply(self, fn, recurse=True):
        # Keep inv_freq fp32 and initialised whatever .to(dtype) / .to_empty() did to it.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(*self._params).to(self.inv_freq.device)
        return self

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q [n, Hq, D], k [n, Hkv, D], positions [n] -> rotated (q, k)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PagedAttention(nn.Module):
    """GQA self-attention whose K/V live in the paged cache.

    New tokens' K/V are written at ``ctx.slots``, then the backend attends every query to its
    sequence's cached prefix plus the new tokens.
    """

    def __init__(self, layer_idx: int, hidden: int, heads: HeadShape, rope: RotaryEmbedding,
                 qkv_bias: bool = False, o_bias: bool = False):
        super().__init__()
        self.layer_idx, self.heads, self.rope = layer_idx, heads, rope
        d = heads.head_dim
        self.q_proj = nn.Linear(hidden, heads.num_qo_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, heads.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, heads.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(heads.num_qo_heads * d, hidden, bias=o_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, h = x.shape[0], self.heads
        q = self.q_proj(x).view(n, h.num_qo_heads, h.head_dim)
        k = self.k_proj(x).view(n, h.num_kv_heads, h.head_dim)
        v = self.v_proj(x).view(n, h.num_kv_heads, h.head_dim)
        q, k = self.rope(q, k, positions)
        k_cache, v_cache = ctx.kv[self.layer_idx, 0], ctx.kv[self.layer_idx, 1]
        k_cache.view(-1, h.num_kv_heads, h.head_dim).index_copy_(0, ctx.slots, k.to(k_cache.dtype))
        v_cache.view(-1, h.num_kv_heads, h.head_dim).index_copy_(0, ctx.slots, v.to(v_cache.dtype))
        o = ctx.backend.run(q, k_cache, v_cache)
        return self.o_proj(o.reshape(n, h.num_qo_heads * h.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, self_attn: PagedAttention, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))
