"""BAGEL's knobs: the placement's ``model_kwargs`` (fixed at start) and a request's
``model_kwargs`` (checked by the conductor; every error names its field)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mstar.models.bagel.flow import FlowParams
from mstar.models.bagel.media import Fit
from mstar.models.bagel.schema import MAX_NEW_TOKENS, MAX_STEPS, BagelRequest, BagelSettings
from mstar.models.base import InvalidArgument
from mstar.models.knobs import KnobError


@dataclass(frozen=True)
class Settings:
    """Placement ``model_kwargs`` (``schema.BagelSettings``), parsed."""

    checkpoint: str
    dtype: str | None
    cfg_parallel: bool
    kv_cache_bytes: int | None
    gpu_memory_fraction: float
    prefill_attention: str
    max_images: int
    max_side: int
    vae_image: tuple[int, int]
    vit_image: tuple[int, int]

    @classmethod
    def from_kwargs(cls, kw: dict[str, Any]) -> Settings:
        s = cls(**BagelSettings.parse({k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()},
                                      model="bagel").given())
        for name in ("vae_image", "vit_image"):
            v = getattr(s, name)
            if not 0 < v[1] <= v[0]:
                raise ValueError(f"model_kwargs.{name} must be [max_side, min_side] with 0 < min_side <= max_side, got {list(v)}")
        return s

    @property
    def vae_fit(self) -> Fit:
        return Fit(*self.vae_image, 16)

    @property
    def vit_fit(self) -> Fit:
        return Fit(*self.vit_image, 14)


DEFAULTS = {  # per mode, as the reference's demo sets them
    "text_to_image": dict(cfg_text=4.0, cfg_img=1.0, cfg_interval=(0.4, 1.0), cfg_renorm="global"),
    "edit": dict(cfg_text=4.0, cfg_img=2.0, cfg_interval=(0.0, 1.0), cfg_renorm="text_channel"),
    "understand": dict(cfg_text=1.0, cfg_img=1.0, cfg_interval=(0.0, 1.0), cfg_renorm="global"),
}


def validate(kwargs: dict[str, Any], settings: Settings, has_image: bool, max_seq_len: int) -> dict[str, Any]:
    """A request's knobs, checked and with the mode's defaults filled in."""
    data = {k: tuple(v) if k == "cfg_interval" and isinstance(v, list) else v for k, v in kwargs.items()}
    try:
        kw = BagelRequest.parse(data, model="bagel", sep=": ").given()
    except KnobError as e:
        raise InvalidArgument(e.key, e.description) from None
    mode = kw["mode"] or ("understand" if has_image else "text_to_image")
    kw.update({k: v for k, v in DEFAULTS[mode].items() if kw[k] is None}, mode=mode)
    for key in ("height", "width"):
        if key in kwargs and mode != "text_to_image":  # never silently ignored
            raise InvalidArgument(f"model_kwargs.{key}", f"mode '{mode}' keeps the input image's size (fitted to the "
                                                         f"placement's vae_image); leave {key} out")
        if kw[key] > settings.max_side:
            raise InvalidArgument(f"model_kwargs.{key}", f"must be at most {settings.max_side} here, got {kw[key]}")
    if kw["n"] > settings.max_images:
        raise InvalidArgument("model_kwargs.n", f"must be at most {settings.max_images} here, got {kw['n']}")
    if mode == "understand" and kw["n"] != 1:
        raise InvalidArgument("model_kwargs.n", "understanding answers once; leave n out")
    lo, hi = kw["cfg_interval"]
    if not 0 <= lo <= hi <= 1:
        raise InvalidArgument("model_kwargs.cfg_interval", f"must be [start, end] with 0 <= start <= end <= 1, got {[lo, hi]}")
    for key in ("max_tokens", "think_max_tokens"):
        if kw[key] > max_seq_len:
            raise InvalidArgument(f"model_kwargs.{key}", f"must be at most max_seq_len={max_seq_len}, got {kw[key]}")
    return kw


def flow_params(kw: dict[str, Any], height: int, width: int) -> FlowParams:
    return FlowParams(height, width, kw["steps"], float(kw["timestep_shift"]), float(kw["cfg_text"]), float(kw["cfg_img"]),
                      (float(kw["cfg_interval"][0]), float(kw["cfg_interval"][1])), kw["cfg_renorm"],
                      float(kw["cfg_renorm_min"]))


__all__ = ["MAX_NEW_TOKENS", "MAX_STEPS", "Settings", "flow_params", "validate"]
