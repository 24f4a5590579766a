"""π0.5's blocks, written for this repository, fp32 / bf16 alike: norms and softmax in fp32, weights
and activations in the module's dtype. Module and parameter names follow the checkpoint's
(openpi ``PI0Pytorch``) so loading is a rename-free ``load_state_dict``.

- ``SiglipVision``: SigLIP So400m/14 (pre-LN encoder, GELU-tanh MLP, post-LayerNorm, no pooling head).
- ``GemmaLayer``: a Gemma decoder layer's weights (RMSNorm (1 + w), 8 query heads over 1 KV head,
  RoPE, gated GELU-tanh MLP); with ``adaptive`` its norms are adaRMS (a ``dense`` per norm gives
  scale, shift and gate from the flow-time condition; no learned weight).
- ``time_embedding``: sin / cos of t over periods ``min_period`` .. ``max_period``, in fp64.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.pi05.config import GemmaConfig, VisionConfig
from mstar.services.engines.layers import FusedProjections


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as scores to add: 0 where allowed, a huge negative elsewhere. Finite, as the
    reference's, so a row with nothing allowed (a padded query) stays finite instead of NaN."""
    return torch.zeros((), dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


# -- SigLIP -----------------------------------------------------------------------------------


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.hidden, cfg.patch, stride=cfg.patch)
        self.position_embedding = nn.Embedding(cfg.tokens, cfg.hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))  # [N, hidden, g, g]
        return x.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipAttention(FusedProjections, nn.Module):
    fused_groups = {"qkv": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(cfg.hidden, cfg.hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = self.fused(x).view(n, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, -1))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(cfg.hidden, cfg.mlp), nn.Linear(cfg.mlp, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))


class SiglipLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps), nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.self_attn, self.mlp = SiglipAttention(cfg), SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.layers))


class SiglipVision(nn.Module):
    """pixels [N, 3, S, S] in [-1, 1] -> [N, tokens, hidden]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.embeddings, self.encoder = SiglipEmbeddings(cfg), SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


# -- Gemma ------------------------------------------------------------------------------------


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x), the mean square taken in fp32 (the result is fp32)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Gemma's: rms(x) * (1 + w), in fp32, back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class AdaRMSNorm(nn.Module):
    """adaRMS: ``dense(cond)`` = (scale, shift, gate); rms(x) * (1 + scale) + shift in fp32, and the
    gate for the residual ``x + gate * branch``. ``modulation`` is precomputable (it depends on t only)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor, modulation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``modulation`` [B, 3 * dim] (or [3 * dim]): x [B, T, dim] -> (normed, gate [B, 1, dim])."""
        scale, shift, gate = modulation.unsqueeze(-2).chunk(3, dim=-1)
        out = rms(x, self.eps) * (1.0 + scale.float()) + shift.float()
        return out.to(x.dtype), gate.to(x.dtype)


class GemmaAttention(FusedProjections, nn.Module):
    fused_groups = {"qkv": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.q_proj = nn.Linear(cfg.width, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.width, bias=False)


class GemmaMLP(FusedProjections, nn.Module):
    fused_groups = {"gate_up": ("gate_proj", "up_proj")}

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.width, cfg.mlp, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.mlp, bias=False)
        self.down_proj = nn.Linear(cfg.mlp, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fused(x).chunk(2, dim=-1)
        return self.down_proj(gelu_tanh(gate) * up)


class GemmaLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, adaptive: bool = False):
        super().__init__()
        norm = AdaRMSNorm if adaptive else RMSNorm
        self.input_layernorm, self.post_attention_layernorm = norm(cfg.width, cfg.eps), norm(cfg.width, cfg.eps)
        self.self_attn, self.mlp = GemmaAttention(cfg), GemmaMLP(cfg)
        self.cfg = cfg

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [B, T, width] (normed), cos / sin [B, T, D] -> q [B, T, heads, D] (the projection's own
        layout: no transpose), k / v [B, kv_heads, T, D] (the cache's), RoPE applied."""
        b, t, _ = h.shape
        c, d = self.cfg, self.cfg.head_dim
        q, k, v = self.self_attn.fused(h).view(b, t, -1, d).split([c.heads, c.kv_heads, c.kv_heads], dim=2)
        cq, sq = cos[:, :, None], sin[:, :, None]
        return rope(q, cq, sq), rope(k, cq, sq).transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                kv_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A plain (RMSNorm) layer: x [B, T, width] -> (x out, k, v); ``kv_only``: skip all but K / V
        (x comes back unchanged)."""
        q, k, v = self.qkv(self.input_layernorm(x), cos, sin)
        if kv_only:
            return x, k, v
        x = x + self.self_attn.o_proj(attend(q, k, v, mask))
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention, one softmax over all keys: q [B, T, H, D], k / v [B, Hkv, S, D],
    ``mask`` additive, broadcastable to [B, 1, T, S] -> [B, T, H * D].

    The query heads of a KV head are folded into its rows in (token, head) order: with one KV head
    (Gemma's) q and the result are views of the projections' [B, T, H * D] layout, so no transpose
    is copied on either side, and no K / V are repeated. Written out as the reference's eager
    attention is (scores in the activations' dtype, softmax in fp32): two GEMMs and one fused
    softmax under torch.compile. A fused SDPA kernel is slower at these shapes: one KV head and few
    query rows give it a handful of thread blocks (cuDNN's took 58 us a layer for the expert's
    400 x 1018 scores at batch 1 on an H100)."""
    b, t, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qf = q.view(b, t, hkv, g, d).transpose(1, 2).reshape(b, hkv, t * g, d)
    m = mask if mask.shape[-2] == 1 else mask.repeat_interleave(g, dim=-2)  # a key-only mask broadcasts
    scores = torch.matmul(qf, k.transpose(-1, -2)) * d**-0.5
    weights = torch.softmax(scores.float() + m, dim=-1).to(v.dtype)
    out = torch.matmul(weights, v).view(b, hkv, t, g, d)
    return out.transpose(1, 2).reshape(b, t, h * d)


def rope_inv_freq(cfg: GemmaConfig, device: torch.device | str | None = None) -> torch.Tensor:
    exponent = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).float() / cfg.head_dim
    return 1.0 / (cfg.rope_theta**exponent)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos / sin [B, T, D] for integer positions [B, T] (angles in fp32)."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def time_embedding(t: torch.Tensor, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """[N] flow times -> [N, dim] (sin | cos), computed in fp64, returned in t's dtype."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * t[:, None].double()
    return torch.cat([angle.sin(), angle.cos()], dim=1).to(t.dtype)


def euler_times(num_steps: int) -> list[float]:
    """The flow times of the Euler steps from t = 1 with dt = -1/num_steps, accumulated in fp32 as
    openpi's ``sample_actions`` does (``time += dt`` on a float32 tensor): 1.0, 0.9, 0.8000001, ..."""
    t, dt = np.float32(1.0), np.float32(-1.0 / num_steps)
    out = []
    for _ in range(num_steps):
        out.append(float(t))
        t = np.float32(t + dt)
    return out
