"""π0.5's three parts, one module per graph node, and the whole inference written with them:

- ``VisionTower``: camera images -> SigLIP -> projector (1152 -> 2048), not rescaled;
- ``PrefixLM``: image tokens + prompt embeddings (scaled by sqrt(width) once) through Gemma-2B,
  bidirectional over the valid tokens -> every layer's K / V (the prefix never sees the suffix);
- ``ActionExpert``: one Euler step of the flow, the Gemma-300M expert with adaRMS whose layer i
  attends over layer i's prefix K / V and its own (one softmax), positions continuing after the valid
  prefix. The adaRMS modulation depends on t only, so it is tabulated per step at load time.

``sample_actions`` chains them as the reference's ``sample_actions`` does (tests and the benchmark).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.pi05.config import Pi05Config
from mstar.models.pi05.layers import (
    AdaRMSNorm,
    GemmaLayer,
    SiglipVision,
    additive_mask,
    attend,
    euler_times,
    rope_inv_freq,
    rope_tables,
    time_embedding,
)

#: The expert's key count (prefix + its own) is padded with masked keys to a multiple of this.
KEY_ALIGN = 64


def pixels_from_uint8(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., 3, S, S] -> [-1, 1] in ``dtype`` (openpi: x / 255 * 2 - 1, in fp32)."""
    return (images.float() / 255.0 * 2.0 - 1.0).to(dtype)


class VisionTower(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.cfg = cfg
        self.vision = SiglipVision(cfg.vision)
        self.projector = nn.Linear(cfg.vision.hidden, cfg.prefix.width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] in [-1, 1] -> image tokens [N, tokens, prefix width]."""
        return self.projector(self.vision(pixels))


def encode_cameras(tower: VisionTower, pixels: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
    """pixels [B, cameras, 3, S, S] in [-1, 1] -> [B, cameras * T, W]: one SigLIP batch over the
    present cameras of every request; a masked camera is not encoded (its rows are zeros, and masked)."""
    b, c = image_mask.shape
    dtype = tower.projector.weight.dtype
    out = torch.zeros(b, c, tower.cfg.vision.tokens, tower.cfg.prefix.width, dtype=dtype, device=pixels.device)
    if image_mask.any():
        out[image_mask] = tower(pixels[image_mask].to(dtype))
    return out.flatten(1, 2)


class PrefixLM(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.prefix.width)
        self.layers = nn.ModuleList(GemmaLayer(cfg.prefix) for _ in range(cfg.prefix.depth))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.prefix), persistent=False)

    def forward(self, image_tokens: torch.Tensor, image_mask: torch.Tensor, tokens: torch.Tensor,
                token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """image_tokens [B, cameras * T, W], image_mask [B, cameras], tokens / token_mask [B, L] ->
        (kv [B, layers, 2, kv_heads, P, head_dim] (K after RoPE), valid [B, P])."""
        t = self.cfg.vision.tokens
        text = self.embed_tokens(tokens) * math.sqrt(self.cfg.prefix.width)
        x = torch.cat([image_tokens.to(text.dtype), text], dim=1)
        valid = torch.cat([image_mask.repeat_interleave(t, dim=1), token_mask], dim=1)
        cos, sin = rope_tables(valid.long().cumsum(1) - 1, self.inv_freq, x.dtype)
        # keys masked only: a padded query attends to the valid keys (its row is never read by a
        # valid one), so no row is empty and no [P, P] mask is built
        mask = additive_mask(valid[:, None, None, :], x.dtype)
        kv = []
        for i, layer in enumerate(self.layers):
            # the last layer's output is never read: only its K / V are
            x, k, v = layer(x, cos, sin, mask, kv_only=i == len(self.layers) - 1)
            kv.append(torch.stack([k, v], dim=1))
        return torch.stack(kv, dim=1), valid


class ActionExpert(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.cfg = cfg
        e = cfg.expert
        self.layers = nn.ModuleList(GemmaLayer(e, adaptive=True) for _ in range(e.depth))
        self.norm = AdaRMSNorm(e.width, e.eps)
        self.action_in_proj = nn.Linear(cfg.action_dim, e.width)
        self.action_out_proj = nn.Linear(e.width, cfg.action_dim)
        self.time_mlp_in = nn.Linear(e.width, e.width)
        self.time_mlp_out = nn.Linear(e.width, e.width)
        self.register_buffer("inv_freq", rope_inv_freq(e), persistent=False)
        self.times = euler_times(cfg.num_steps)
        self.dt = -1.0 / cfg.num_steps
        self.register_buffer("modulation", torch.zeros(cfg.num_steps, 2 * e.depth + 1, 3 * e.width), persistent=False)

    @torch.no_grad()
    def tabulate(self) -> None:
        """The adaRMS modulation of every step (time MLP, then each norm's dense), in fp32: call once
        the weights are loaded, before a cast to a lower precision."""
        t = torch.tensor(self.times, dtype=torch.float32, device=self.time_mlp_in.weight.device)
        emb = time_embedding(t, self.cfg.expert.width, self.cfg.min_period, self.cfg.max_period)
        f = lambda lin, x: nn.functional.linear(x, lin.weight.float(), lin.bias.float())  # noqa: E731
        cond = nn.functional.silu(f(self.time_mlp_out, nn.functional.silu(f(self.time_mlp_in, emb))))
        norms = [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.modulation = torch.stack([f(n.dense, cond) for n in [*norms, self.norm]], dim=1)

    def velocity(self, x: torch.Tensor, kv: torch.Tensor, prefix_valid: torch.Tensor, step: int) -> torch.Tensor:
        """The flow's velocity at step ``step`` (t = ``times[step]``): x [B, H, action_dim] fp32, kv
        [B, layers, 2, kv_heads, P, D], prefix_valid [B, P] -> [B, H, action_dim] fp32."""
        return self.core(x, kv, prefix_valid, self.modulation[step])

    def compile(self, **kwargs) -> None:
        """Run the step's tensor function under ``torch.compile`` (its elementwise chains fused: the
        step is ~1000 small kernels eagerly); the flow time enters as a tensor, so one compilation
        serves every step, and one more (batch dim dynamic) every batch size past 1."""
        self.core = torch.compile(self.velocity_core, **kwargs)

    def core(self, x, kv, prefix_valid, mod):
        return self.velocity_core(x, kv, prefix_valid, mod)

    def velocity_core(self, x: torch.Tensor, kv: torch.Tensor, prefix_valid: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        """``velocity`` with the step's adaRMS modulation ``mod`` [2 * depth + 1, 3 * width] given."""
        dtype = self.layers[0].self_attn.q_proj.weight.dtype
        h = self.action_in_proj(x.to(self.action_in_proj.weight.dtype)).to(dtype)
        b, n = h.shape[:2]
        positions = prefix_valid.sum(1, keepdim=True) + torch.arange(n, device=h.device)
        cos, sin = rope_tables(positions, self.inv_freq, dtype)
        # the keys (prefix, own, then masked zeros) padded to a multiple of KEY_ALIGN: the score
        # rows' stride then suits the tensor-core GEMMs (1018 keys ran as align-2 kernels)
        pad = -(prefix_valid.shape[1] + n) % KEY_ALIGN
        allowed = torch.cat([prefix_valid, prefix_valid.new_ones(b, n), prefix_valid.new_zeros(b, pad)], dim=1)
        mask = additive_mask(allowed[:, None, None, :], dtype)
        for i, layer in enumerate(self.layers):
            normed, gate = layer.input_layernorm(h, mod[2 * i])
            q, k, v = layer.qkv(normed, cos, sin)
            keys = torch.cat([kv[:, i, 0].to(dtype), F.pad(k, (0, 0, 0, pad))], dim=2)
            values = torch.cat([kv[:, i, 1].to(dtype), F.pad(v, (0, 0, 0, pad))], dim=2)
            h = h + layer.self_attn.o_proj(attend(q, keys, values, mask)) * gate
            normed, gate = layer.post_attention_layernorm(h, mod[2 * i + 1])
            h = h + layer.mlp(normed) * gate
        out, _ = self.norm(h, mod[-1])
        return self.action_out_proj(out.to(self.action_out_proj.weight.dtype)).float()

    def step(self, x: torch.Tensor, kv: torch.Tensor, prefix_valid: torch.Tensor, step: int) -> torch.Tensor:
        """One Euler step: x + dt * v (dt = -1 / num_steps; a Python scalar times a float32 tensor is
        float32(dt) times it, as the reference's float32 ``dt`` tensor)."""
        return x + self.dt * self.velocity(x, kv, prefix_valid, step)


class Pi05(nn.Module):
    """The three parts together (tests, benchmark): ``sample_actions`` is the reference's inference."""

    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.cfg = cfg
        self.vision, self.prefix, self.expert = VisionTower(cfg), PrefixLM(cfg), ActionExpert(cfg)

    def embed_images(self, pixels: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
        return encode_cameras(self.vision, pixels, image_mask)

    @torch.no_grad()
    def sample_actions(self, pixels, image_mask, tokens, token_mask, noise) -> torch.Tensor:
        kv, valid = self.prefix(self.embed_images(pixels, image_mask), image_mask, tokens, token_mask)
        x = noise
        for i in range(self.cfg.num_steps):
            x = self.expert.step(x, kv, valid, i)
        return x
