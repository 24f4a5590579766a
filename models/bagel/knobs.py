"""BAGEL's knobs: the placement's ``model_kwargs`` (fixed at start) and a request's
``model_kwargs`` (checked by the conductor; every error names its field)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from mstar.models.bagel.flow import RENORM, FlowParams
from mstar.models.bagel.media import Fit
from mstar.models.bagel.requests import MODES
from mstar.models.base import InvalidArgument

DEFAULT_CHECKPOINT = "ByteDance-Seed/BAGEL-7B-MoT"
MAX_STEPS = 100  # flow timesteps a request may ask for (Euler steps: one fewer)
MAX_NEW_TOKENS = 4096  # decode loop bound; a request's max_tokens is at most this and max_seq_len


@dataclass(frozen=True)
class Settings:
    """Placement ``model_kwargs``."""

    checkpoint: str = DEFAULT_CHECKPOINT
    dtype: str | None = None  # float32 | bfloat16 | float16; default bfloat16 on a GPU, float32 on a CPU
    cfg_parallel: bool = False  # image_gen_cfg: the three CFG branches as nodes of their own (placed apart)
    kv_cache_bytes: int | None = None  # default: 64 MiB on a CPU, gpu_memory_fraction of free memory on a GPU
    gpu_memory_fraction: float = 0.5
    max_images: int = 4  # a request's n
    max_side: int = 1024  # generated image height / width limit (at most the latent table: 64 x 16)
    vae_image: tuple[int, int] = (1024, 512)  # input images for the VAE: longest side at most, shortest at least
    vit_image: tuple[int, int] = (980, 224)  # ... and then for the ViT

    @classmethod
    def from_kwargs(cls, kw: dict[str, Any]) -> Settings:
        known = set(cls.__dataclass_fields__)
        for key in kw:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ValueError(f"model_kwargs.{key}: unknown key for model 'bagel'{hint} known: {', '.join(sorted(known))}")
        s = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})
        if s.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"model_kwargs.dtype must be float32, bfloat16 or float16, got {s.dtype!r}")
        if not 0 < s.gpu_memory_fraction < 1:
            raise ValueError(f"model_kwargs.gpu_memory_fraction must be in (0, 1), got {s.gpu_memory_fraction}")
        for name in ("vae_image", "vit_image"):
            v = getattr(s, name)
            if len(v) != 2 or not all(isinstance(x, int) and x > 0 for x in v) or v[1] > v[0]:
                raise ValueError(f"model_kwargs.{name} must be [max_side, min_side] with 0 < min_side <= max_side, got {v}")
        return s

    @property
    def vae_fit(self) -> Fit:
        return Fit(*self.vae_image, 16)

    @property
    def vit_fit(self) -> Fit:
        return Fit(*self.vit_image, 14)


DEFAULTS = {  # per mode, as the reference's demo sets them
    "text_to_image": dict(cfg_text=4.0, cfg_img=1.0, cfg_interval=[0.4, 1.0], cfg_renorm="global"),
    "edit": dict(cfg_text=4.0, cfg_img=2.0, cfg_interval=[0.0, 1.0], cfg_renorm="text_channel"),
    "understand": dict(cfg_text=1.0, cfg_img=1.0, cfg_interval=[0.0, 1.0], cfg_renorm="global"),
}
REQUEST_KEYS = ("mode", "think", "height", "width", "steps", "timestep_shift", "cfg_text", "cfg_img", "cfg_interval",
                "cfg_renorm", "cfg_renorm_min", "seed", "n", "max_tokens", "think_max_tokens")
SPELLINGS = {"num_timesteps": "steps", "num_inference_steps": "steps", "cfg_text_scale": "cfg_text",
             "cfg_img_scale": "cfg_img", "guidance_scale": "cfg_text", "cfg_renorm_type": "cfg_renorm",
             "max_think_token_n": "think_max_tokens", "image_shapes": "height and width", "max_new_tokens": "max_tokens"}


def _number(kw, key, lo, hi, integer=False):
    v = kw[key]
    if isinstance(v, bool) or not isinstance(v, int if integer else int | float) or not lo <= v <= hi:
        what = "an integer" if integer else "a number"
        raise InvalidArgument(f"model_kwargs.{key}", f"must be {what} in [{lo}, {hi}], got {v!r}")
    return v


def validate(kwargs: dict[str, Any], settings: Settings, has_image: bool, max_seq_len: int) -> dict[str, Any]:
    """A request's knobs, checked and with the mode's defaults filled in."""
    for key in kwargs:
        if key not in REQUEST_KEYS:
            hint = f"; M* calls it {SPELLINGS[key]}" if key in SPELLINGS else ""
            close = difflib.get_close_matches(key, REQUEST_KEYS, n=1)
            hint = hint or (f"; did you mean '{close[0]}'?" if close else "")
            raise InvalidArgument(f"model_kwargs.{key}", f"unknown key for model 'bagel'{hint} known: {', '.join(REQUEST_KEYS)}")
    mode = kwargs.get("mode", "understand" if has_image else "text_to_image")
    if mode not in MODES:
        raise InvalidArgument("model_kwargs.mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
    kw = {"mode": mode, "think": False, "height": 1024, "width": 1024, "steps": 50, "timestep_shift": 3.0,
          "cfg_renorm_min": 0.0, "seed": None, "n": 1, "max_tokens": 512, "think_max_tokens": 1024,
          **DEFAULTS[mode], **kwargs}
    if not isinstance(kw["think"], bool):
        raise InvalidArgument("model_kwargs.think", f"must be true or false, got {kw['think']!r}")
    side = settings.max_side
    for key in ("height", "width"):
        _number(kw, key, 16, side, integer=True)
        if kw[key] % 16:
            raise InvalidArgument(f"model_kwargs.{key}", f"must be a multiple of 16, got {kw[key]}")
    _number(kw, "steps", 2, MAX_STEPS, integer=True)
    _number(kw, "timestep_shift", 0.1, 100.0)
    _number(kw, "cfg_text", 0.0, 100.0)
    _number(kw, "cfg_img", 0.0, 100.0)
    _number(kw, "cfg_renorm_min", 0.0, 1.0)
    _number(kw, "n", 1, settings.max_images, integer=True)
    limit = min(MAX_NEW_TOKENS, max_seq_len)
    _number(kw, "max_tokens", 1, limit, integer=True)
    _number(kw, "think_max_tokens", 1, limit, integer=True)
    iv = kw["cfg_interval"]
    if (not isinstance(iv, list | tuple) or len(iv) != 2 or any(isinstance(b, bool) or not isinstance(b, int | float) for b in iv)
            or not 0 <= iv[0] <= iv[1] <= 1):
        raise InvalidArgument("model_kwargs.cfg_interval", f"must be [start, end] with 0 <= start <= end <= 1, got {iv!r}")
    if kw["cfg_renorm"] not in RENORM:
        raise InvalidArgument("model_kwargs.cfg_renorm", f"must be one of {', '.join(RENORM)}, got {kw['cfg_renorm']!r}")
    seed = kw["seed"]
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
        raise InvalidArgument("model_kwargs.seed", f"must be a non-negative integer, got {seed!r}")
    if mode == "understand" and kw["n"] != 1:
        raise InvalidArgument("model_kwargs.n", "understanding answers once; leave n out")
    return kw


def flow_params(kw: dict[str, Any], height: int, width: int) -> FlowParams:
    return FlowParams(height, width, kw["steps"], float(kw["timestep_shift"]), float(kw["cfg_text"]), float(kw["cfg_img"]),
                      (float(kw["cfg_interval"][0]), float(kw["cfg_interval"][1])), kw["cfg_renorm"],
                      float(kw["cfg_renorm_min"]))
