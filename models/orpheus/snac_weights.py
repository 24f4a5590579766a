"""SNAC checkpoint layout: weight-norm folding, decode-path selection, full key/shape list.

`snac` 1.2.1 wraps every conv in `torch.nn.utils.parametrizations.weight_norm`, so a conv weight is
stored as `<m>.parametrizations.weight.original0` (g, the norm, shape (C0, 1, 1)) and
`...original1` (v, the direction); weight = g * v / ||v|| with the norm over all dims but 0
(`torch._weight_norm(v, g, 0)`). Older torch `weight_norm` saved the same pair as
`<m>.weight_g` / `<m>.weight_v`; both are accepted. The published `hubertsiuzdak/snac_24khz`
`pytorch_model.bin` uses the parametrization names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from .snac_config import SnacConfig

WEIGHT_FILE = "pytorch_model.bin"
_PAIRS = ((".parametrizations.weight.original0", ".parametrizations.weight.original1"), (".weight_g", ".weight_v"))
# The decode path: the decoder stack and, per level, the codebook and output projection.
_DECODE_PATH = re.compile(r"^(decoder\.|quantizer\.quantizers\.\d+\.(codebook|out_proj)\.)")


def read_snac_state_dict(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = directory / WEIGHT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"SNAC weights not found: {path} (expected snac's {WEIGHT_FILE})")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict, got {type(state).__name__}")
    return path, state


def fold_weight_norm(state: Mapping[str, torch.Tensor], *, source: object = "state dict") -> dict[str, torch.Tensor]:
    """Replace every (g, v) weight-norm pair by the plain `<m>.weight` it parametrizes."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        for g_suffix, v_suffix in _PAIRS:
            if key.endswith(v_suffix):
                break  # handled with its g
            if key.endswith(g_suffix):
                base = key[: -len(g_suffix)]
                v = state.get(base + v_suffix)
                if v is None:
                    raise KeyError(f"{source}: tensor {key!r} has no partner {base + v_suffix!r}")
                out[base + ".weight"] = torch._weight_norm(v.float(), tensor.float(), 0)
                break
        else:
            out[key] = tensor
    for key in state:
        for g_suffix, v_suffix in _PAIRS:
            if key.endswith(v_suffix) and key[: -len(v_suffix)] + g_suffix not in state:
                raise KeyError(f"{source}: tensor {key!r} has no partner {key[: -len(v_suffix)] + g_suffix!r}")
    return out


def decode_path_state_dict(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *, source: object
) -> dict[str, torch.Tensor]:
    """Folded decode-path tensors checked against `expected` (our module's state dict).

    Encoder and `in_proj` tensors are ignored. Errors name the file and the tensor.
    """
    folded = {k: v for k, v in fold_weight_norm(state, source=source).items() if _DECODE_PATH.match(k)}
    missing = sorted(set(expected) - set(folded))
    if missing:
        raise KeyError(
            f"{source}: missing tensor {missing[0]!r} (weight-normed convs are stored as "
            f"'.parametrizations.weight.original0/1' or '.weight_g/_v'); {len(missing)} missing in all"
        )
    unexpected = sorted(set(folded) - set(expected))
    if unexpected:
        raise KeyError(f"{source}: unexpected decode-path tensor {unexpected[0]!r} for this config.json")
    for key, want in expected.items():
        if tuple(folded[key].shape) != tuple(want.shape):
            raise ValueError(
                f"{source}: tensor {key!r} has shape {tuple(folded[key].shape)}, "
                f"expected {tuple(want.shape)} from config.json"
            )
    return {k: folded[k].float() for k in expected}


def encoder_shapes(cfg: SnacConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the encoder and `in_proj` tensors (not decoded, but `SNAC.load_state_dict` is
    strict), keyed with folded `.weight` names as `snac.layers.Encoder` / `snac.vq` lay them out."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name: str, c_in: int, c_out: int, k: int, groups: int = 1) -> None:
        shapes[f"{name}.weight"] = (c_out, c_in // groups, k)
        shapes[f"{name}.bias"] = (c_out,)

    d = cfg.encoder_dim
    conv("encoder.block.0", 1, d, 7)
    for i, stride in enumerate(cfg.encoder_rates):
        block = f"encoder.block.{i + 1}.block"
        groups = d if cfg.depthwise else 1
        for j in range(3):
            shapes[f"{block}.{j}.block.0.alpha"] = (1, d, 1)
            conv(f"{block}.{j}.block.1", d, d, 7, groups)
            shapes[f"{block}.{j}.block.2.alpha"] = (1, d, 1)
            conv(f"{block}.{j}.block.3", d, d, 1)
        shapes[f"{block}.3.alpha"] = (1, d, 1)
        conv(f"{block}.4", d, 2 * d, 2 * stride)
        d *= 2
    conv(f"encoder.block.{len(cfg.encoder_rates) + 1}", d, d, 7, d if cfg.depthwise else 1)
    for i in range(len(cfg.vq_strides)):
        conv(f"quantizer.quantizers.{i}.in_proj", cfg.latent, cfg.codebook_dim, 1)
    return shapes


def unfold_weight_norm(state: Mapping[str, torch.Tensor], gains: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Write plain conv weights in snac's parametrization form: v = weight, g = gains[key]
    (shape (C0, 1, 1)); keys absent from `gains` are copied as they are."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key in gains:
            base = key[: -len(".weight")]
            out[base + _PAIRS[0][0]] = gains[key].reshape(-1, *([1] * (tensor.dim() - 1))).clone()
            out[base + _PAIRS[0][1]] = tensor.clone()
        else:
            out[key] = tensor.clone()
    return out
