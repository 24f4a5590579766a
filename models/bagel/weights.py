"""Loading BAGEL's official checkpoint: ``ema.safetensors`` holds the whole model under the
reference's module names (``language_model.*``, ``vit_model.vision_model.*``, ``connector.*``,
``time_embedder.*``, ``vae2llm`` / ``llm2vae``, the two position tables), ``ae.safetensors`` the FLUX
VAE under FLUX's names. Each of our modules maps its parameter names to those; a node reads only
the tensors of its own module. Missing tensors are named (the first few, and how many)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from mstar.models.bagel.config import AE, EMA, BagelConfig
from mstar.models.hub import CheckpointError

_EXPERT = {  # our Expert child -> (understanding name, generation name) under language_model.model.layers.{i}.
    "input_norm": ("input_layernorm", "input_layernorm_moe_gen"),
    "post_norm": ("post_attention_layernorm", "post_attention_layernorm_moe_gen"),
    **{p: (f"self_attn.{p}", f"self_attn.{p}_moe_gen") for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
    **{p: (f"mlp.{p}", f"mlp_moe_gen.{p}") for p in ("gate_proj", "up_proj", "down_proj")},
}
#: our buffers filled from the checkpoint when it has them (else their sin-cos values stay)
OPTIONAL = {"pos_table"}


def llm_name(ours: str) -> str:
    """``BagelLLM`` parameter -> ema.safetensors name."""
    m = re.fullmatch(r"layers\.(\d+)\.(und|gen)\.(\w+)\.(weight|bias)", ours)
    if m:
        i, expert, child, kind = m.groups()
        return f"language_model.model.layers.{i}.{_EXPERT[child][expert == 'gen']}.{kind}"
    fixed = {"embed_tokens.weight": "language_model.model.embed_tokens.weight", "norm.weight": "language_model.model.norm.weight",
             "norm_gen.weight": "language_model.model.norm_moe_gen.weight", "lm_head.weight": "language_model.lm_head.weight"}
    return fixed[ours]


def vit_name(ours: str) -> str:
    """``VisionEncoder`` parameter -> ema.safetensors name."""
    base = "vit_model.vision_model."
    if ours.startswith("layers."):
        _, i, child, kind = ours.split(".")
        sub = f"self_attn.{child}" if child.endswith("_proj") else (f"mlp.{child}" if child.startswith("fc") else child)
        return f"{base}encoder.layers.{i}.{sub}.{kind}"
    if ours.startswith(("patch_embedding.", "position_embedding.")):
        return f"{base}embeddings.{ours}"
    if ours.startswith("post_layernorm."):
        return base + ours
    if ours.startswith("connector_"):
        return "connector." + ours[len("connector_"):]
    if ours == "pos_table":
        return "vit_pos_embed.pos_embed"
    raise KeyError(ours)


def latent_name(ours: str) -> str:
    """``LatentAdapter`` parameter -> ema.safetensors name."""
    return "latent_pos_embed.pos_embed" if ours == "pos_table" else ours


def vae_name(ours: str) -> str:
    return ours


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters())
    out.update((n, b) for n, b in module.named_buffers() if n.split(".")[-1] in OPTIONAL)
    return out


def load_into(module: nn.Module, path: Path, name: Callable[[str], str]) -> nn.Module:
    """Fill ``module``'s parameters (and optional tables) from the safetensors file at ``path``."""
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    wanted = _tensors(module)
    missing: list[str] = []
    with safe_open(str(path), "pt") as f, torch.no_grad():
        have = set(f.keys())
        for ours, dst in wanted.items():
            src = name(ours)
            if src not in have:
                if ours.split(".")[-1] not in OPTIONAL:
                    missing.append(src)
                continue
            t = f.get_tensor(src)
            if ours == "patch_embedding.weight" and t.dim() == 4:  # a Conv2d stem: to the Linear's (row, col, channel) order
                t = t.permute(0, 2, 3, 1).reshape(t.shape[0], -1)
            if tuple(t.shape) != tuple(dst.shape):
                raise CheckpointError(f"{path}: tensor {src!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(t.to(dst.dtype))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: missing tensors {', '.join(missing[:5])}{more}")
    return module


def build(cls, cfg_arg, directory: Path, which: str, device: str, dtype: torch.dtype) -> nn.Module:
    """Construct one of BAGEL's modules on ``device`` and load it from the checkpoint directory."""
    from mstar.models.bagel.flow import LatentAdapter
    from mstar.models.bagel.llm import BagelLLM
    from mstar.models.bagel.vae import AutoEncoder
    from mstar.models.bagel.vit import VisionEncoder

    names = {BagelLLM: (EMA, llm_name), VisionEncoder: (EMA, vit_name), LatentAdapter: (EMA, latent_name),
             AutoEncoder: (AE, vae_name)}
    file, name = names[cls]
    with torch.device("meta"):
        module = cls(cfg_arg)
    module = module.to_empty(device=device)
    _refill_tables(module, cfg_arg)
    load_into(module, directory / file, name)
    return module.to(dtype).requires_grad_(False).eval()


def _refill_tables(module: nn.Module, cfg_arg) -> None:
    """Meta construction leaves buffers empty: recompute the sin-cos tables (RoPE's frequencies
    refill themselves in ``to_empty``)."""
    from mstar.models.bagel.vit import sincos_2d

    if hasattr(module, "pos_table"):
        side, dim = cfg_arg.max_latent_size, cfg_arg.llm.hidden_size
        if type(module).__name__ == "VisionEncoder":
            side = cfg_arg.vit_max_patches_per_side
        module.pos_table = sincos_2d(dim, side).to(module.pos_table.device)


def ckpt_names(cfg: BagelConfig) -> dict[str, list[str]]:
    """Every ema.safetensors / ae.safetensors name our modules read (tests, writers)."""
    from mstar.models.bagel.flow import LatentAdapter
    from mstar.models.bagel.llm import BagelLLM
    from mstar.models.bagel.vae import AutoEncoder
    from mstar.models.bagel.vit import VisionEncoder

    with torch.device("meta"):
        parts = [(BagelLLM(cfg.llm), llm_name), (VisionEncoder(cfg), vit_name), (LatentAdapter(cfg), latent_name)]
        vae = AutoEncoder(cfg.vae)
    return {EMA: [name(n) for m, name in parts for n in _tensors(m)], AE: list(_tensors(vae))}


__all__ = ["build", "ckpt_names", "llm_name", "latent_name", "load_into", "vae_name", "vit_name"]
