"""Load a Hugging Face safetensors checkpoint directory into a module by parameter name
(fused parameters such as ``qkv_proj`` from the checkpoint tensors they stack).

Accepts ``model.safetensors``, sharded ``*.safetensors`` with ``model.safetensors.index.json``,
or any ``*.safetensors`` set. Strict: a missing, unexpected or mis-shaped tensor raises
``WeightLoadError`` naming the file and the tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class Shard:
    """A tensor-parallel rank's piece of a checkpoint tensor: chunk ``rank`` of ``size`` along ``dim``."""

    dim: int
    rank: int
    size: int

    def take(self, t: torch.Tensor, name: str, source: str) -> torch.Tensor:
        if t.shape[self.dim] % self.size:
            raise WeightLoadError(f"{source}: tensor '{name}' dim {self.dim} ({t.shape[self.dim]}) does not split "
                                  f"over {self.size} tensor-parallel ranks")
        return t.chunk(self.size, self.dim)[self.rank]


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: rows [start, start + rows) of dim 0 of ``param``
    (``rows`` None: the whole parameter); with ``shard``, only this tensor-parallel rank's
    chunk of the checkpoint tensor; with ``zero``, zeros (the bias of a row-parallel layer
    on ranks past 0: the all-reduce adds rank 0's once)."""

    param: str
    start: int = 0
    rows: int | None = None
    shard: Shard | None = None
    zero: bool = False


def checkpoint_targets(module: nn.Module, tp_rank: int = 0, tp_size: int = 1) -> dict[str, Target]:
    """Checkpoint tensor name -> its target. A parameter loads from its own name unless its
    module fuses checkpoint modules: a submodule's ``checkpoint_rows()`` maps a fused child
    (``qkv_proj``) to the checkpoint children stacked along its rows (``q_proj``, ``k_proj``,
    ``v_proj`` with their row counts), for each of the child's parameters (weight, bias).
    With ``tp_size`` > 1, a submodule's ``tp_split()`` names the parameters split over ranks
    and the dim (0: output rows, 1: input columns) they split along."""
    targets = {name: Target(name) for name, _ in module.named_parameters(remove_duplicate=False)}
    if tp_size > 1:
        split = _tp_targets(module, tp_rank, tp_size)
        targets = {name: replace(t, **split.get(name, {})) for name, t in targets.items()}
    for prefix, sub in module.named_modules():
        rows_of = getattr(sub, "checkpoint_rows", None)
        if rows_of is None:
            continue
        dot = f"{prefix}." if prefix else ""
        for fused, parts in rows_of().items():
            for pname in [n for n in targets if n.startswith(f"{dot}{fused}.")]:
                suffix = pname[len(f"{dot}{fused}.") :]
                split = targets.pop(pname)
                start = 0
                for part, rows in parts:
                    targets[f"{dot}{part}.{suffix}"] = Target(pname, start, rows, split.shard, split.zero)
                    start += rows
    return targets


def _tp_targets(module: nn.Module, rank: int, size: int) -> dict[str, dict]:
    """Parameter -> the Target fields that split it over tensor-parallel ranks."""
    out: dict[str, dict] = {}
    for prefix, sub in module.named_modules():
        split = getattr(sub, "tp_split", None)
        if split is None:
            continue
        dot = f"{prefix}." if prefix else ""
        for rel, dim in split().items():
            out[dot + rel] = {"shard": Shard(dim, rank, size)}
            if dim == 1 and rel.endswith(".weight"):  # a row-parallel layer: its bias is added once
                out[f"{dot}{rel[: -len('weight')]}bias"] = {"zero": rank > 0}
    return out


def load_checkpoint(
    module: nn.Module,
    directory: str | Path,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    tied: dict[str, str] | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> None:
    """Copy every parameter of ``module`` from the checkpoint, casting to the parameter's dtype
    (fused parameters from their parts, tensor-parallel ranks their shards: see
    ``checkpoint_targets``).

    ``tied`` maps a parameter that may be absent from the checkpoint to the one it shares
    storage with (default: ``lm_head.weight`` -> ``model.embed_tokens.weight`` when the
    module ties them).
    """
    where = checkpoint_files(directory)
    files = ", ".join(sorted({f.name for f in where.values()}))
    names = _plan(module, where, ignore, tied, lambda n: f"{where[n]}", f"{directory}", f"looked in {files}")
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(where[name], []).append(name)
    targets = checkpoint_targets(module, tp_rank, tp_size)
    params = dict(module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for f, file_names in by_file.items():
            with safe_open(str(f), framework="pt") as sf:
                for name in file_names:
                    _copy(params, targets[name], name, sf.get_tensor(name), str(f))


def load_state_dict(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    ignore: Iterable[str] = DEFAULT_IGNORE,
    tied: dict[str, str] | None = None,
    source: str = "state dict",
) -> None:
    """``load_checkpoint`` from tensors in memory under checkpoint names (a Hugging Face
    model's ``state_dict()``), with the same checks."""
    names = _plan(module, tensors, ignore, tied, lambda n: source, source, "not in the state dict")
    targets, params = checkpoint_targets(module), dict(module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in names:
            _copy(params, targets[name], name, tensors[name], source)


def _plan(module: nn.Module, available: Mapping[str, object], ignore: Iterable[str], tied: dict[str, str] | None,
          origin: Callable[[str], str], source: str, looked: str) -> list[str]:
    """Checkpoint names to copy; raises on an unexpected or a missing tensor."""
    targets = checkpoint_targets(module)
    tied = _default_ties(module) if tied is None else tied
    skip = [re.compile(p) for p in ignore]
    extra = [n for n in available if n not in targets and not any(p.match(n) for p in skip)]
    if extra:
        raise WeightLoadError(
            f"{origin(extra[0])}: tensor '{extra[0]}' has no parameter in {type(module).__name__}"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    names = []
    for name in targets:
        if name in available:
            names.append(name)
        elif tied.get(name) not in available:
            raise WeightLoadError(f"{source}: tensor '{name}' missing ({looked})")
    return names


def _copy(params: dict[str, nn.Parameter], target: Target, name: str, t: torch.Tensor, source: str) -> None:
    p = params[target.param]
    dst = p if target.rows is None else p[target.start : target.start + target.rows]
    sh = target.shard
    part = sh.take(t, name, source) if sh is not None else t
    if tuple(part.shape) != tuple(dst.shape):
        per_rank = f" on each of {sh.size} tensor-parallel ranks (split along dim {sh.dim})" if sh else ""
        raise WeightLoadError(
            f"{source}: tensor '{name}' has shape {tuple(t.shape)}, the model expects {tuple(dst.shape)}{per_rank}"
        )
    if target.zero:
        dst.zero_()
    else:
        dst.copy_(part.to(p.dtype))


def _default_ties(module: nn.Module) -> dict[str, str]:
    params = dict(module.named_parameters(remove_duplicate=False))
    head, emb = params.get("lm_head.weight"), params.get("model.embed_tokens.weight")
    if head is not None and head is emb:
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}
