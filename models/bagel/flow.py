"""Image latents as LLM tokens, and the flow that denoises them.

A VAE latent [16, 2h, 2w] becomes h·w tokens of 2·2·16 = 64 values; ``vae2llm`` lifts a token
to the LLM's width, plus the embedding of its flow time t (the shifted t in [0, 1]; 0 for a clean
image) and a fixed sin-cos position at row·64+col; ``llm2vae`` reads a velocity back out.

Generation starts from noise at t = 1 and takes Euler steps x ← x - v·dt down a schedule of N
times t' = s·t / (1 + (s-1)·t) (N-1 steps). Inside the CFG interval each step combines three
velocities, from the conditional context and from the text- and image-unconditional ones:
v_text = v_u_text + s_text·(v - v_u_text), then the image CFG, then a renorm that keeps the
norm at most the conditional one's (over the whole image, per token, or text-only per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mstar.models.bagel.config import BagelConfig
from mstar.models.bagel.vit import sincos_2d

RENORM = ("global", "channel", "text_channel")


class TimestepEmbedder(nn.Module):
    """DiT's: cos | sin of t at 128 frequencies, then Linear -> SiLU -> Linear."""

    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.mlp[0].weight.dtype))


class LatentAdapter(nn.Module):
    """vae2llm / llm2vae, the time embedding and the latent position table."""

    def __init__(self, cfg: BagelConfig):
        super().__init__()
        h, d = cfg.llm.hidden_size, cfg.patch_latent_dim
        self.max_side = cfg.max_latent_size
        self.time_embedder = TimestepEmbedder(h)
        self.vae2llm = nn.Linear(d, h)
        self.llm2vae = nn.Linear(h, d)
        self.register_buffer("pos_table", sincos_2d(h, cfg.max_latent_size), persistent=False)

    def embed(self, tokens: torch.Tensor, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Latent tokens [h·w, 64] at flow time t (a 0-d or [1] tensor) -> LLM inputs [h·w, hidden]."""
        ids = (torch.arange(h)[:, None] * self.max_side + torch.arange(w)).flatten().to(tokens.device)
        temb = self.time_embedder(t.reshape(1).to(tokens.device))
        return self.vae2llm(tokens.to(self.vae2llm.weight.dtype)) + temb + self.pos_table[ids].to(temb.dtype)


def patchify_latent(latent: torch.Tensor, p: int = 2) -> torch.Tensor:
    """[C, p·h, p·w] -> [h·w, p·p·C] (each token ordered row, col, channel)."""
    c, hh, ww = latent.shape
    x = latent.reshape(c, hh // p, p, ww // p, p)
    return torch.einsum("chpwq->hwpqc", x).reshape(-1, p * p * c)


def unpatchify_latent(tokens: torch.Tensor, h: int, w: int, p: int = 2) -> torch.Tensor:
    """[h·w, p·p·C] -> [C, p·h, p·w]."""
    c = tokens.shape[-1] // (p * p)
    x = tokens.reshape(h, w, p, p, c)
    return torch.einsum("hwpqc->chpwq", x).reshape(c, h * p, w * p)


def schedule(num_timesteps: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, dt) of the num_timesteps - 1 Euler steps, in float32 as the reference computes them."""
    t = torch.linspace(1, 0, num_timesteps)
    t = shift * t / (1 + (shift - 1) * t)
    return t[:-1], t[:-1] - t[1:]


@dataclass(frozen=True)
class FlowParams:
    """One request's image generation knobs (also its node inputs: ``as_tensor`` / ``from_tensor``)."""

    height: int
    width: int
    num_timesteps: int = 50
    shift: float = 3.0
    cfg_text: float = 4.0
    cfg_img: float = 1.0
    interval: tuple[float, float] = (0.4, 1.0)
    renorm: str = "global"
    renorm_min: float = 0.0

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.height, self.width, self.num_timesteps, self.shift, self.cfg_text, self.cfg_img,
                             *self.interval, RENORM.index(self.renorm), self.renorm_min], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> FlowParams:
        v = t.tolist()
        return cls(int(v[0]), int(v[1]), int(v[2]), v[3], v[4], v[5], (v[6], v[7]), RENORM[int(v[8])], v[9])

    def latent_hw(self, downsample: int) -> tuple[int, int]:
        return self.height // downsample, self.width // downsample

    def scales(self, t: float) -> tuple[float, float]:
        """(cfg_text, cfg_img) in force at time t: both 1 outside the interval (lo, hi]."""
        lo, hi = (float(np.float32(b)) for b in self.interval)  # compared in float32, as the reference's tensor t
        return (self.cfg_text, self.cfg_img) if lo < t <= hi else (1.0, 1.0)


def cfg_combine(v: torch.Tensor, v_text: torch.Tensor | None, v_img: torch.Tensor | None, cfg_text: float,
                cfg_img: float, renorm: str, renorm_min: float = 0.0) -> torch.Tensor:
    """One image's guided velocity [tokens, 64] from the conditional ``v`` and the text- and
    image-unconditional ones (needed only where their scale is above 1)."""
    if cfg_text <= 1.0:
        return v
    guided = v_text + cfg_text * (v - v_text)
    if renorm == "text_channel":
        scale = (v.norm(dim=-1, keepdim=True) / (guided.norm(dim=-1, keepdim=True) + 1e-8)).clamp(renorm_min, 1.0)
        guided = guided * scale
        return v_img + cfg_img * (guided - v_img) if cfg_img > 1.0 else guided
    if cfg_img > 1.0:
        guided = v_img + cfg_img * (guided - v_img)
    if renorm == "global":
        scale = (v.norm() / (guided.norm() + 1e-8)).clamp(renorm_min, 1.0)
    elif renorm == "channel":
        scale = (v.norm(dim=-1, keepdim=True) / (guided.norm(dim=-1, keepdim=True) + 1e-8)).clamp(renorm_min, 1.0)
    else:
        raise ValueError(f"renorm must be one of {', '.join(RENORM)}, got {renorm!r}")
    return guided * scale


def decode_pixels(image: torch.Tensor) -> torch.Tensor:
    """VAE output [3, H, W] in about [-1, 1] -> uint8 [H, W, 3], truncating as the reference does."""
    return ((image.float() * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 0) * 255).to(torch.uint8)


__all__ = ["RENORM", "FlowParams", "LatentAdapter", "TimestepEmbedder", "cfg_combine", "decode_pixels", "draw_noise",
           "patchify_latent", "schedule", "unpatchify_latent"]


def draw_noise(seed: int, tokens: int, dim: int, posterior_shape: tuple[int, ...] | None = None
               ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(VAE posterior eps or None, initial latent noise [tokens, dim]) from one CPU stream seeded
    with ``seed``, drawn in the reference's order (the input image's posterior sample first): a
    CPU run of the reference after ``torch.manual_seed(seed)`` draws the same numbers."""
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(posterior_shape, generator=g) if posterior_shape is not None else None
    return eps, torch.randn(tokens, dim, generator=g)
