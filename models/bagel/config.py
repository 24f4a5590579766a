"""BAGEL's shapes, read from the official checkpoint layout: ``llm_config.json`` (Qwen2.5 + QK-norm,
every layer a Mixture-of-Transformers of an understanding and a generation expert),
``vit_config.json`` (SigLIP NaViT; one layer fewer runs than it lists), and the FLUX VAE's shapes
read from ``ae.safetensors`` itself (the official layout has no VAE config file)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.models.hub import CheckpointError

LLM_CONFIG, VIT_CONFIG, EMA, AE = "llm_config.json", "vit_config.json", "ema.safetensors", "ae.safetensors"
TOKENIZER = "tokenizer.json"
REQUIRED_FILES = (LLM_CONFIG, VIT_CONFIG, EMA, AE, TOKENIZER)
BOS, EOS, SOI, EOI = "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"


@dataclass(frozen=True)
class LLMConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def heads(self):
        from mstar.services.engines.attention import HeadShape

        return HeadShape(self.num_heads, self.num_kv_heads, self.head_dim)

    def kv_spec(self, page_size: int, dtype):
        from mstar.services.engines.kv_cache import KVCacheSpec

        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, page_size, dtype)


@dataclass(frozen=True)
class ViTConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int  # layers that run: the config's num_hidden_layers - 1, as the reference builds it
    num_heads: int
    patch_size: int = 14
    image_size: int = 980
    layer_norm_eps: float = 1e-6
    num_channels: int = 3

    @property
    def max_patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class VAEConfig:
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    in_channels: int = 3
    out_ch: int = 3
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


@dataclass(frozen=True)
class SpecialTokens:
    bos: int  # <|im_start|>: opens every text block and starts decoding
    eos: int  # <|im_end|>: closes a text block, ends decoding
    soi: int  # <|vision_start|>
    eoi: int  # <|vision_end|>


@dataclass(frozen=True)
class BagelConfig:
    llm: LLMConfig
    vit: ViTConfig
    vae: VAEConfig
    tokens: SpecialTokens
    latent_patch_size: int = 2
    max_latent_size: int = 64  # the latent position table is max_latent_size² rows
    vit_max_patches_per_side: int = 70
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def latent_downsample(self) -> int:
        """Image pixels per latent token side: VAE /8 times the 2x2 patch."""
        return self.vae.downsample * self.latent_patch_size

    @property
    def patch_latent_dim(self) -> int:
        return self.latent_patch_size ** 2 * self.vae.z_channels

    @property
    def max_image_side(self) -> int:
        return self.max_latent_size * self.latent_downsample


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def llm_config(cfg: dict[str, Any], source: str = LLM_CONFIG) -> LLMConfig:
    try:
        return LLMConfig(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 1e6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768))
    except KeyError as e:
        raise CheckpointError(f"{source}: missing key {e.args[0]!r}") from None


def vit_config(cfg: dict[str, Any], source: str = VIT_CONFIG) -> ViTConfig:
    try:
        layers = int(cfg["num_hidden_layers"]) - 1  # the reference drops the last layer
        if layers < 1:
            raise CheckpointError(f"{source}: num_hidden_layers={layers + 1}; BAGEL runs all but the last, so it needs >= 2")
        return ViTConfig(
            hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]), num_layers=layers,
            num_heads=int(cfg["num_attention_heads"]), patch_size=int(cfg.get("patch_size", 14)),
            image_size=int(cfg.get("image_size", 980)), layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-6)),
            num_channels=int(cfg.get("num_channels", 3)))
    except KeyError as e:
        raise CheckpointError(f"{source}: missing key {e.args[0]!r}") from None


def vae_config(shapes: dict[str, tuple[int, ...]], source: str = AE) -> VAEConfig:
    """The FLUX VAE's widths from its tensors: conv_in gives ch, each down level's first conv its
    width, the blocks per level the count, conv_out twice the latent channels."""
    def shape(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise CheckpointError(f"{source}: missing tensor {name!r}")
        return shapes[name]

    ch = shape("encoder.conv_in.weight")[0]
    levels = 1 + max(int(k.split(".")[2]) for k in shapes if k.startswith("encoder.down."))
    blocks = 1 + max(int(k.split(".")[4]) for k in shapes if k.startswith("encoder.down.0.block."))
    mult = tuple(shape(f"encoder.down.{i}.block.0.conv1.weight")[0] // ch for i in range(levels))
    return VAEConfig(ch=ch, ch_mult=mult, num_res_blocks=blocks, z_channels=shape("encoder.conv_out.weight")[0] // 2,
                     in_channels=shape("encoder.conv_in.weight")[1], out_ch=shape("decoder.conv_out.weight")[0])


def special_tokens(tokenizer_file: Path) -> SpecialTokens:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    ids = {}
    for name in (BOS, EOS, SOI, EOI):
        i = tok.token_to_id(name)
        if i is None:
            raise CheckpointError(f"{tokenizer_file}: no token {name!r} (BAGEL's Qwen2.5 tokenizer has it)")
        ids[name] = i
    return SpecialTokens(ids[BOS], ids[EOS], ids[SOI], ids[EOI])


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)


def config_from_dir(path: str | Path) -> BagelConfig:
    d = Path(path)
    for f in REQUIRED_FILES:
        if not (d / f).is_file():
            raise CheckpointError(f"missing file {d / f} (BAGEL's checkpoint holds {', '.join(REQUIRED_FILES)})")
    llm = llm_config(read_json(d / LLM_CONFIG), str(d / LLM_CONFIG))
    vit = vit_config(read_json(d / VIT_CONFIG), str(d / VIT_CONFIG))
    vae = vae_config(safetensors_shapes(d / AE), str(d / AE))
    ema = safetensors_shapes(d / EMA)
    latent = ema.get("latent_pos_embed.pos_embed")
    vit_pos = ema.get("vit_pos_embed.pos_embed")
    return BagelConfig(llm, vit, vae, special_tokens(d / TOKENIZER),
                       max_latent_size=math.isqrt(latent[0]) if latent else 64,
                       vit_max_patches_per_side=math.isqrt(vit_pos[0]) if vit_pos else 70)
