"""The FLUX autoencoder (16 latent channels, /8), with the FLUX checkpoint's own tensor names
(``encoder.down.0.block.0.norm1.weight``, ``decoder.mid.attn_1.q.weight``, ...): ResNet blocks
with GroupNorm(32) and SiLU, one single-head attention block in the middle, stride-2 convolutions
padded on the right and bottom only, nearest-neighbour upsampling. Latents are scaled and
shifted: z = scale · (posterior - shift)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.bagel.config import VAEConfig


def _norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, c, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm = _norm(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        y = self.norm(x)
        q, k, v = (p(y).flatten(2).transpose(1, 2)[:, None] for p in (self.q, self.k, self.v))  # [b, 1, hw, c]
        o = F.scaled_dot_product_attention(q, k, v)[:, 0].transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj_out(o)


class Downsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _mid(c: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1, mid.attn_1, mid.block_2 = ResnetBlock(c, c), AttnBlock(c), ResnetBlock(c, c)
    return mid


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        ch, mult = cfg.ch, cfg.ch_mult
        self.conv_in = nn.Conv2d(cfg.in_channels, ch, 3, padding=1)
        self.down = nn.ModuleList()
        cin = ch
        for i, m in enumerate(mult):
            level = nn.Module()
            level.block = nn.ModuleList()
            for _ in range(cfg.num_res_blocks):
                level.block.append(ResnetBlock(cin, ch * m))
                cin = ch * m
            if i != len(mult) - 1:
                level.downsample = Downsample(cin)
            self.down.append(level)
        self.mid = _mid(cin)
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, 2 * cfg.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            for block in level.block:
                h = block(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        ch, mult = cfg.ch, cfg.ch_mult
        cin = ch * mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, cin, 3, padding=1)
        self.mid = _mid(cin)
        up: list[nn.Module] = []
        for i in reversed(range(len(mult))):
            level = nn.Module()
            level.block = nn.ModuleList()
            for _ in range(cfg.num_res_blocks + 1):
                level.block.append(ResnetBlock(cin, ch * mult[i]))
                cin = ch * mult[i]
            if i != 0:
                level.upsample = Upsample(cin)
            up.insert(0, level)  # up[i] is the level at resolution i, as the checkpoint names it
        self.up = nn.ModuleList(up)
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, cfg.out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for level in reversed(self.up):
            for block in level.block:
                h = block(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class AutoEncoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder, self.decoder = Encoder(cfg), Decoder(cfg)

    def encode(self, x: torch.Tensor, eps: torch.Tensor | None = None) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> scaled latents [B, 16, H/8, W/8]: the posterior's mean
        plus std · ``eps`` (a sample, as the reference draws one) or the mean alone."""
        mean, logvar = self.encoder(x).chunk(2, dim=1)
        z = mean if eps is None else mean + torch.exp(0.5 * logvar) * eps.to(mean)
        return self.cfg.scale_factor * (z - self.cfg.shift_factor)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Scaled latents -> images in about [-1, 1]."""
        return self.decoder(z / self.cfg.scale_factor + self.cfg.shift_factor)
