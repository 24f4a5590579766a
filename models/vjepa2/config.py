"""Shapes of the three networks, from a Hugging Face ``config.json`` or inferred from an official
``.pt`` checkpoint's tensors (head counts, which tensors cannot show, from ``PRESET_HEADS`` or a
``config.json`` in our own schema beside the file)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: attention heads by width: ViT-L / ViT-H (16), ViT-g (22), the masked predictor (12); the AC
#: predictor (1024 wide) has 16 as ViT-L
PRESET_HEADS = {1024: 16, 1280: 16, 1408: 22, 384: 12}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _check_heads(where: str, dim: int, heads: int) -> None:
    if heads < 1 or dim % heads:
        raise ValueError(f"{where}: width {dim} is not a multiple of heads={heads}")
    if (dim // heads) % 2:
        raise ValueError(f"{where}: head_dim {dim // heads} must be even (RoPE rotates pairs)")


@dataclass(frozen=True)
class EncoderConfig:
    dim: int = 1024
    depth: int = 24
    heads: int = 16
    mlp_dim: int = 4096
    patch: int = 16
    tubelet: int = 2
    crop: int = 256  # pixels (square); positions follow the clip's own grid
    frames: int = 64  # frames per clip the checkpoint was trained on (a served clip's upper bound)
    in_chans: int = 3
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_heads("encoder", self.dim, self.heads)

    @property
    def grid(self) -> int:
        return self.crop // self.patch

    @property
    def tokens_per_tubelet(self) -> int:
        return self.grid * self.grid


@dataclass(frozen=True)
class PredictorConfig:
    """The masked predictor (V-JEPA 2 pretraining head)."""

    dim: int = 384
    depth: int = 12
    heads: int = 12
    mlp_dim: int = 1536
    num_mask_tokens: int = 10
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_heads("predictor", self.dim, self.heads)


@dataclass(frozen=True)
class ACConfig:
    """The action-conditioned predictor (V-JEPA 2-AC)."""

    dim: int = 1024
    depth: int = 24
    heads: int = 16
    mlp_dim: int = 4096
    action_dim: int = 7  # xyz, xyz-Euler angles, gripper
    max_frames: int = 32  # frames the reference's block-causal mask covers (num_frames 64 / tubelet 2)
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_heads("ac_predictor", self.dim, self.heads)

    @property
    def cond_tokens(self) -> int:
        return 2  # [action, state] before each frame's tokens


@dataclass(frozen=True)
class VJepa2Config:
    encoder: EncoderConfig
    predictor: PredictorConfig | None = None
    ac: ACConfig | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": "mstar-vjepa2", "encoder": asdict(self.encoder)}
        if self.predictor is not None:
            out["predictor"] = asdict(self.predictor)
        if self.ac is not None:
            out["ac_predictor"] = asdict(self.ac)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> VJepa2Config:
        if d.get("format") == "mstar-vjepa2":
            return cls(EncoderConfig(**d["encoder"]),
                       PredictorConfig(**d["predictor"]) if "predictor" in d else None,
                       ACConfig(**d["ac_predictor"]) if "ac_predictor" in d else None)
        return cls.from_hf(d)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> VJepa2Config:
        """transformers' ``VJEPA2Config`` (``config.json`` of ``facebook/vjepa2-*``)."""
        dim = d.get("hidden_size", 1024)
        patch = d.get("patch_size", 16)
        enc = EncoderConfig(dim=dim, depth=d.get("num_hidden_layers", 24), heads=d.get("num_attention_heads", 16),
                            mlp_dim=int(dim * d.get("mlp_ratio", 4.0)), patch=patch if isinstance(patch, int) else patch[0],
                            tubelet=d.get("tubelet_size", 2), crop=d.get("crop_size", 256),
                            frames=d.get("frames_per_clip", 64), in_chans=d.get("in_chans", 3),
                            eps=d.get("layer_norm_eps", 1e-6))
        pdim = d.get("pred_hidden_size", 384)
        pred = PredictorConfig(dim=pdim, depth=d.get("pred_num_hidden_layers", 12),
                               heads=d.get("pred_num_attention_heads", 12),
                               mlp_dim=int(pdim * d.get("pred_mlp_ratio", 4.0)),
                               num_mask_tokens=d.get("pred_num_mask_tokens", 10), eps=d.get("layer_norm_eps", 1e-6))
        return cls(enc, pred, None)
