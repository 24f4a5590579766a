"""SNAC `config.json`, read the way `snac.SNAC.from_config` reads it (`SNAC(**config)`).

Missing keys take `snac.SNAC.__init__`'s defaults (those describe the 44 kHz music model), so a
config that omits `attn_window_size` means local attention, which we reject: only the
attention-free 24 kHz speech model (`hubertsiuzdak/snac_24khz`) is supported. Its config is
  sampling_rate 24000, encoder_dim 48, encoder_rates [2, 4, 8, 8], decoder_dim 1024,
  decoder_rates [8, 8, 4, 2], attn_window_size null, codebook_size 4096, codebook_dim 8,
  vq_strides [4, 2, 1], noise true, depthwise true.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SnacConfig:
    sampling_rate: int = 44100
    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (3, 3, 7, 7)
    latent_dim: int | None = None
    decoder_dim: int = 1536
    decoder_rates: tuple[int, ...] = (7, 7, 3, 3)
    attn_window_size: int | None = 32
    codebook_size: int = 4096
    codebook_dim: int = 8
    vq_strides: tuple[int, ...] = (8, 4, 2, 1)
    noise: bool = True
    depthwise: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("encoder_rates", "decoder_rates", "vq_strides"):
                if not isinstance(value, list | tuple) or not all(isinstance(v, int) for v in value):
                    raise ValueError(f"SNAC {f.name} must be a list of integers, got {value!r}")
                object.__setattr__(self, f.name, tuple(value))
            elif f.name in ("noise", "depthwise"):
                if not isinstance(value, bool):
                    raise ValueError(f"SNAC {f.name} must be true or false, got {value!r}")
            elif value is None and f.name in ("latent_dim", "attn_window_size"):
                pass
            elif not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"SNAC {f.name} must be an integer, got {value!r}")
        if self.attn_window_size is not None:
            raise ValueError(
                f"SNAC attn_window_size={self.attn_window_size}: local attention (32/44 kHz models) "
                "is not supported; set attn_window_size to null (the 24 kHz speech model)"
            )
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ValueError(
                f"SNAC decoder_dim={self.decoder_dim} must be divisible by 2**len(decoder_rates)="
                f"{2 ** len(self.decoder_rates)} (each decoder block halves the channels)"
            )
        if not self.vq_strides or any(s < 1 for s in self.vq_strides):
            raise ValueError(f"SNAC vq_strides must be positive, got {list(self.vq_strides)}")
        if any(self.vq_strides[0] % s for s in self.vq_strides):
            raise ValueError(f"SNAC vq_strides[0] must be a multiple of every stride, got {self.vq_strides}")

    @property
    def latent(self) -> int:
        """Channels of the quantized latent (snac: encoder_dim * 2**len(encoder_rates) if unset)."""
        if self.latent_dim is not None:
            return self.latent_dim
        return self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def upsampling(self) -> int:
        """Output samples per latent step (512 for 24 kHz)."""
        return math.prod(self.decoder_rates)

    @property
    def samples_per_frame(self) -> int:
        """Samples per coarsest code, i.e. per Orpheus 7-token frame (2048 for 24 kHz)."""
        return self.upsampling * self.vq_strides[0]

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> SnacConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown SNAC config keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> SnacConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"SNAC config not found: {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict in snac's key names (lists, not tuples)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out
