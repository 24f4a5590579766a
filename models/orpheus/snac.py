"""Our SNAC 24 kHz decoder: codes of 3 levels -> float32 waveform, decode path only.

Architecture as `snac` 1.2.1 defines it (`snac/layers.py`, `snac/vq.py`):
  quantizer  per level i: codebook lookup (4096 x 8) -> 1x1 conv to the latent -> repeat
             `vq_strides[i]` times along time; the levels are summed.
  decoder    depthwise k7 conv + 1x1 conv, then per rate r a DecoderBlock
             [Snake, ConvTranspose(k=2r, stride r), NoiseBlock, 3 ResidualUnits (dilation 1, 3, 9)],
             then Snake, k7 conv to 1 channel, tanh.
Module names mirror snac's state-dict keys, so a checkpoint loads by name once its weight-norm
pairs are folded into plain `.weight` tensors (see `snac_weights.py`): every conv in snac is
weight-normed, and we fold at load time because the decode path never trains.

Noise: snac's NoiseBlock adds `torch.randn((B, 1, T)) * conv1x1(x)` on every call, in eval too, so
the reference decode is random. We draw the same shapes in the same order, so with the global RNG
(generator=None) and the same `torch.manual_seed` our output equals snac's; pass a
`torch.Generator` for reproducible serving, or `noise=False` to leave it out (not the reference).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from .snac_config import SnacConfig
from .snac_weights import decode_path_state_dict, read_snac_state_dict


class Snake(nn.Module):
    """x + sin(alpha * x)^2 / (alpha + 1e-9), per channel (snac's jit `snake`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, groups: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake(dim),
            nn.Conv1d(dim, dim, kernel_size=7, dilation=dilation, padding=3 * dilation, groups=groups),
            Snake(dim),
            nn.Conv1d(dim, dim, kernel_size=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)  # "same" padding: lengths match, snac's crop is a no-op


class NoiseBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Conv1d(dim, dim, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        b, _, t = x.shape
        noise = torch.randn((b, 1, t), generator=generator, device=x.device, dtype=x.dtype)
        return x + noise * self.linear(x)


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, stride: int, noise: bool, groups: int):
        super().__init__()
        layers: list[nn.Module] = [
            Snake(in_dim),
            nn.ConvTranspose1d(
                in_dim, out_dim, kernel_size=2 * stride, stride=stride,
                padding=math.ceil(stride / 2), output_padding=stride % 2,
            ),
        ]
        if noise:
            layers.append(NoiseBlock(out_dim))
        layers += [ResidualUnit(out_dim, d, groups) for d in (1, 3, 9)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None, noise: bool) -> torch.Tensor:
        for layer in self.block:
            if isinstance(layer, NoiseBlock):
                x = layer(x, generator) if noise else x
            else:
                x = layer(x)
        return x


class Decoder(nn.Module):
    def __init__(self, cfg: SnacConfig):
        super().__init__()
        latent, channels = cfg.latent, cfg.decoder_dim
        if cfg.depthwise:
            layers: list[nn.Module] = [
                nn.Conv1d(latent, latent, kernel_size=7, padding=3, groups=latent),
                nn.Conv1d(latent, channels, kernel_size=1),
            ]
        else:
            layers = [nn.Conv1d(latent, channels, kernel_size=7, padding=3)]
        for i, stride in enumerate(cfg.decoder_rates):
            in_dim, out_dim = channels // 2**i, channels // 2 ** (i + 1)
            groups = out_dim if cfg.depthwise else 1
            layers.append(DecoderBlock(in_dim, out_dim, stride, cfg.noise, groups))
        out_dim = channels // 2 ** len(cfg.decoder_rates)
        layers += [Snake(out_dim), nn.Conv1d(out_dim, 1, kernel_size=7, padding=3), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor, generator: torch.Generator | None, noise: bool) -> torch.Tensor:
        for layer in self.model:
            z = layer(z, generator, noise) if isinstance(layer, DecoderBlock) else layer(z)
        return z


class CodebookLevel(nn.Module):
    def __init__(self, latent: int, codebook_size: int, codebook_dim: int, stride: int):
        super().__init__()
        self.stride = stride
        self.codebook = nn.Embedding(codebook_size, codebook_dim)
        self.out_proj = nn.Conv1d(codebook_dim, latent, kernel_size=1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(self.codebook(codes).transpose(1, 2))
        return z.repeat_interleave(self.stride, dim=-1)


class Quantizer(nn.Module):
    def __init__(self, cfg: SnacConfig):
        super().__init__()
        self.quantizers = nn.ModuleList(
            CodebookLevel(cfg.latent, cfg.codebook_size, cfg.codebook_dim, s) for s in cfg.vq_strides
        )

    def forward(self, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        z = self.quantizers[0](codes[0])
        for level, c in zip(self.quantizers[1:], codes[1:], strict=True):
            z = z + level(c)
        return z


class SnacDecoder(nn.Module):
    """SNAC decode path. State-dict keys are snac's with weight norm folded into `.weight`."""

    def __init__(self, cfg: SnacConfig):
        super().__init__()
        self.config = cfg
        self.quantizer = Quantizer(cfg)
        self.decoder = Decoder(cfg)

    @torch.inference_mode()
    def decode(
        self,
        codes: Sequence[torch.Tensor],
        *,
        generator: torch.Generator | None = None,
        noise: bool = True,
        checked: bool = False,
    ) -> torch.Tensor:
        """codes[i]: integer (B, T_i) with T_i * vq_strides[i] equal -> (B, 1, T * upsampling) float.
        ``checked``: the caller ran ``check_codes`` (on host tensors, before moving them: the
        range check reads values, which on a GPU would wait for the device)."""
        if not checked:
            self.check_codes(codes)
        z = self.quantizer([c.long() for c in codes])
        return self.decoder(z, generator, noise)

    def check_codes(self, codes: Sequence[torch.Tensor]) -> None:
        cfg = self.config
        if len(codes) != len(cfg.vq_strides):
            raise ValueError(f"SNAC decode needs {len(cfg.vq_strides)} code levels, got {len(codes)}")
        steps = set()
        for i, (c, stride) in enumerate(zip(codes, cfg.vq_strides, strict=True)):
            if c.dim() != 2 or c.dtype.is_floating_point:
                raise ValueError(f"codes[{i}] must be an integer (batch, time) tensor, got {c.dtype} {tuple(c.shape)}")
            if c.numel() and (int(c.min()) < 0 or int(c.max()) >= cfg.codebook_size):
                raise ValueError(
                    f"codes[{i}] has values in [{int(c.min())}, {int(c.max())}], "
                    f"outside the codebook [0, {cfg.codebook_size})"
                )
            steps.add((c.shape[0], c.shape[1] * stride))
        if len(steps) != 1:
            raise ValueError(
                f"code levels disagree: (batch, length * stride) per level = {sorted(steps)}, "
                f"strides {list(cfg.vq_strides)}"
            )


def load_snac_decoder(directory: str | Path, *, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> SnacDecoder:
    """Load `config.json` + `pytorch_model.bin` (snac's layout) from a local directory, eval;
    float32 unless ``dtype`` says otherwise (the reference runs float32)."""
    directory = Path(directory)
    cfg = SnacConfig.from_json(directory / "config.json")
    model = SnacDecoder(cfg)
    weights_path, raw = read_snac_state_dict(directory)
    model.load_state_dict(decode_path_state_dict(raw, model.state_dict(), source=weights_path))
    return model.to(device=device, dtype=dtype).eval()
