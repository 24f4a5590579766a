"""π0.5's shapes: the SigLIP So400m/14 vision tower, the Gemma-2B prefix LM, the Gemma-300M action
expert and the flow-matching head, read from a checkpoint's ``config.json``.

lerobot's ``pi05`` config.json names the Gemma variants (``paligemma_variant`` / ``action_expert_variant``)
and the head (``chunk_size``, ``max_action_dim``, ``tokenizer_max_length``, ``image_resolution``,
``num_inference_steps``); an explicit ``vision_config`` / ``paligemma_config`` / ``action_expert_config``
object (the tiny test checkpoints) overrides a variant field by field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


@dataclass(frozen=True)
class VisionConfig:
    hidden: int = 1152
    layers: int = 27
    heads: int = 16
    mlp: int = 4304
    image_size: int = 224
    patch: int = 14
    eps: float = 1e-6

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch) ** 2


@dataclass(frozen=True)
class GemmaConfig:
    width: int
    depth: int
    mlp: int
    heads: int = 8
    kv_heads: int = 1
    head_dim: int = 256
    eps: float = 1e-6
    rope_theta: float = 10_000.0


GEMMA_VARIANTS = {
    "gemma_2b": GemmaConfig(width=2048, depth=18, mlp=16_384),
    "gemma_300m": GemmaConfig(width=1024, depth=18, mlp=4096),
}


@dataclass(frozen=True)
class Pi05Config:
    vision: VisionConfig = field(default_factory=VisionConfig)
    prefix: GemmaConfig = GEMMA_VARIANTS["gemma_2b"]
    expert: GemmaConfig = GEMMA_VARIANTS["gemma_300m"]
    vocab: int = 257_152
    action_dim: int = 32  # the expert's action width (states and actions are padded to it)
    action_horizon: int = 50  # action tokens per chunk (DROID fine-tunes: 15)
    max_token_len: int = 200  # prompt tokens, padded
    num_steps: int = 10
    min_period: float = 4e-3
    max_period: float = 4.0
    cameras: tuple[str, ...] = CAMERAS

    def __post_init__(self) -> None:
        p, e = self.prefix, self.expert
        if (p.depth, p.kv_heads, p.head_dim, p.heads) != (e.depth, e.kv_heads, e.head_dim, e.heads):
            raise ValueError(f"the prefix and the expert attend jointly layer by layer: depth, heads, kv_heads and "
                             f"head_dim must agree, got prefix {p} and expert {e}")
        if e.width % 2:
            raise ValueError(f"the time embedding needs an even expert width, got {e.width}")

    def to_json(self) -> dict[str, Any]:
        return {"type": "pi05", "vision_config": asdict(self.vision), "paligemma_config": asdict(self.prefix),
                "action_expert_config": asdict(self.expert), "vocab_size": self.vocab,
                "max_action_dim": self.action_dim, "chunk_size": self.action_horizon,
                "tokenizer_max_length": self.max_token_len, "num_inference_steps": self.num_steps,
                "min_period": self.min_period, "max_period": self.max_period,
                "image_resolution": [self.vision.image_size, self.vision.image_size]}


def _merge(base, overrides: dict[str, Any] | None, where: str):
    if not overrides:
        return base
    known = set(asdict(base))
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"config.json {where}: unknown keys {unknown}; known: {sorted(known)}")
    return replace(base, **overrides)


def _variant(name: Any, where: str) -> GemmaConfig:
    if name not in GEMMA_VARIANTS:
        raise ValueError(f"config.json {where}: unknown Gemma variant {name!r}; known: {', '.join(GEMMA_VARIANTS)}")
    return GEMMA_VARIANTS[name]


def config_from_json(data: dict[str, Any], action_horizon: int | None = None) -> Pi05Config:
    """The shapes of a checkpoint's config.json; ``action_horizon`` (model_kwargs) overrides ``chunk_size``."""
    res = data.get("image_resolution") or [224, 224]
    if len(res) != 2 or res[0] != res[1]:
        raise ValueError(f"config.json image_resolution: square images only, got {res}")
    vision = _merge(replace(VisionConfig(), image_size=int(res[0])), data.get("vision_config"), "vision_config")
    prefix = _merge(_variant(data.get("paligemma_variant", "gemma_2b"), "paligemma_variant"),
                    data.get("paligemma_config"), "paligemma_config")
    expert = _merge(_variant(data.get("action_expert_variant", "gemma_300m"), "action_expert_variant"),
                    data.get("action_expert_config"), "action_expert_config")
    horizon = int(action_horizon if action_horizon is not None else data.get("chunk_size", 50))
    return Pi05Config(vision=vision, prefix=prefix, expert=expert, vocab=int(data.get("vocab_size", 257_152)),
                      action_dim=int(data.get("max_action_dim", 32)), action_horizon=horizon,
                      max_token_len=int(data.get("tokenizer_max_length", 200)),
                      num_steps=int(data.get("num_inference_steps", 10)),
                      min_period=float(data.get("min_period", 4e-3)), max_period=float(data.get("max_period", 4.0)))


def tiny_config() -> Pi05Config:
    """The test / demo shapes: every structural feature of the real model (8 query heads over 1 KV head,
    14 px patches, 3 camera slots, adaRMS), small widths. 56 px images give 16 tokens a camera."""
    return Pi05Config(vision=VisionConfig(hidden=32, layers=2, heads=4, mlp=64, image_size=56, patch=14),
                      prefix=GemmaConfig(width=64, depth=2, mlp=128, heads=8, kv_heads=1, head_dim=16),
                      expert=GemmaConfig(width=48, depth=2, mlp=96, heads=8, kv_heads=1, head_dim=16),
                      vocab=512, action_dim=32, action_horizon=10, max_token_len=48)
