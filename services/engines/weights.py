"""Load a Hugging Face safetensors checkpoint directory into a module by parameter name.

Accepts ``model.safetensors``, sharded ``*.safetensors`` with ``model.safetensors.index.json``,
or any ``*.safetensors`` set. Strict: a missing, unexpected or mis-shaped tensor raises
``WeightLoadError`` naming the file and the tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

#: Checkpoint tensors that carry no weights of ours (old HF checkpoints saved rotary tables).
DEFAULT_IGNORE = (r".*rotary_emb\.inv_freq$",)


class WeightLoadError(ValueError):
    pass


def checkpoint_files(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightLoadError(f"{index}: no 'weight_map' object")
        out = {}
        for name, fname in weight_map.items():
            f = d / fname
            if not f.exists():
                raise WeightLoadError(f"{index}: tensor '{name}' maps to missing file '{fname}'")
            out[name] = f
        return out
    files = [d / "model.safetensors"] if (d / "model.safetensors").exists() else sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{d}: no model.safetensors, model.safetensors.index.json or *.safetensors")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                out[name] = f
    return out


def load_checkpoint(
    module: nn.Module,
    directory: str | Path,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    tied: dict[str, str] | None = None,
) -> None:
    """Copy every parameter of ``module`` from the checkpoint, casting to the parameter's dtype.

    ``tied`` maps a parameter that may be absent from the checkpoint to the one it shares
    storage with (default: ``lm_head.weight`` -> ``model.embed_tokens.weight`` when the
    module ties them).
    """
    where = checkpoint_files(directory)
    params = dict(module.named_parameters(remove_duplicate=False))
    tied = _default_ties(module) if tied is None else tied
    skip = [re.compile(p) for p in ignore]
    extra = [n for n in where if n not in params and not any(p.match(n) for p in skip)]
    if extra:
        raise WeightLoadError(
            f"{where[extra[0]]}: tensor '{extra[0]}' has no parameter in {type(module).__name__}"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    by_file: dict[Path, list[str]] = {}
    for name in params:
        if name in where:
            by_file.setdefault(where[name], []).append(name)
        elif tied.get(name) not in where:
            files = sorted({f.name for f in where.values()})
            raise WeightLoadError(f"{directory}: tensor '{name}' missing (looked in {', '.join(files)})")
    with torch.no_grad():
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt") as sf:
                for name in names:
                    t = sf.get_tensor(name)
                    p = params[name]
                    if tuple(t.shape) != tuple(p.shape):
                        raise WeightLoadError(
                            f"{f}: tensor '{name}' has shape {tuple(t.shape)}, the model expects {tuple(p.shape)}"
                        )
                    p.copy_(t.to(p.dtype))


def _default_ties(module: nn.Module) -> dict[str, str]:
    params = dict(module.named_parameters(remove_duplicate=False))
    head, emb = params.get("lm_head.weight"), params.get("model.embed_tokens.weight")
    if head is not None and head is emb:
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}
