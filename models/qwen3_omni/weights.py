"""Read Qwen3-Omni's Hugging Face checkpoint (``model.safetensors`` or shards listed in
``model.safetensors.index.json``) into our modules, one part at a time.

Our modules are named as the checkpoint under a prefix (``thinker.``, ``talker.``, ``code2wav.``,
``thinker.audio_tower.``, ``thinker.visual.``), except the routed experts: the checkpoint keeps one
``experts.{e}.{gate,up,down}_proj.weight`` per expert, we stack them per layer into
``experts.gate_up`` [E, 2I, H] and ``experts.down`` [E, H, I]. transformers' in-memory fused names
(``experts.gate_up_proj`` / ``experts.down_proj``) are read too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from mstar.models.hub import CheckpointError

#: a checkpoint directory with this file and no weights holds random weights made on load (full-size
#: benchmarks without writing tens of gigabytes): {"seed": int, "std": float}
RANDOM_MARKER = "random_weights.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class CheckpointReader:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_FILE
        marker = self.directory / RANDOM_MARKER
        self.random: dict | None = json.loads(marker.read_text()) if marker.is_file() else None
        if self.random is not None:
            self.files = {}
        elif index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            self.files = {name: self.directory / f for name, f in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), "pt") as f:
                self.files = {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        else:
            raise CheckpointError(f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE}")
        self._open: dict[Path, object] = {}

    def config(self) -> dict:
        path = self.directory / "config.json"
        if not path.is_file():
            raise CheckpointError(f"missing file {path}")
        return json.loads(path.read_text())

    def names(self, prefix: str) -> list[str]:
        return sorted(n for n in self.files if n.startswith(prefix))

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"{self.directory}: tensor {name} is missing")
        handle = self._open.get(path)
        if handle is None:
            handle = self._open[path] = safe_open(str(path), "pt")
        return handle.get_tensor(name)  # type: ignore[attr-defined]

    def part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices [start, stop) of ``name`` along ``dim``, reading only those; indices past the
        tensor's end read as zeros (a padded last shard)."""
        from safetensors import safe_open

        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"{self.directory}: tensor {name} is missing")
        with safe_open(str(path), "pt") as f:
            sl = f.get_slice(name)
            size = sl.get_shape()[dim]
            index = [slice(None)] * len(sl.get_shape())
            index[dim] = slice(min(start, size), min(stop, size))
            return pad_to(sl[tuple(index)], dim, stop - start)

    def rows(self, name: str, ids: list[int], shape: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor, reading only those (the Talker's three text-special
        embeddings out of the Thinker's 150k-row table); ``shape``: the tensor's, for random weights."""
        from safetensors import safe_open

        if self.random is not None:
            assert shape is not None
            return random_tensor(name, shape, self.random, "cpu", torch.float32)[ids]

        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"{self.directory}: tensor {name} is missing")
        with safe_open(str(path), "pt") as f:
            sl = f.get_slice(name)
            return torch.stack([sl[i : i + 1][0] for i in ids])


def random_tensor(name: str, shape, spec: dict, device, dtype) -> torch.Tensor:
    """A parameter of a random checkpoint, the same wherever it is made (seeded by its name):
    norm weights 1, layer scales 0.01, other vectors 0, matrices N(0, std)."""
    import zlib

    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1:
        norm = "norm" in name or "ln_" in name
        return torch.full(shape, 1.0 if norm and leaf == "weight" else 0.01 if leaf == "scale" else 0.0,
                          device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(int(spec.get("seed", 0)) * 1_000_003 + zlib.crc32(name.encode()))
    out = torch.empty(shape, device=device, dtype=dtype)
    return out.normal_(0.0, float(spec.get("std", 0.02)), generator=g)


def pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim)


def load_module(module: nn.Module, reader: CheckpointReader, prefix: str, dtype: torch.dtype | None = None,
                device: str | torch.device = "cpu", skip: tuple[str, ...] = (), shard=None) -> None:
    """Fill every parameter of ``module`` from ``prefix`` + its name; an absent tensor, an extra
    one under a loaded submodule, or a shape mismatch is an error naming the tensor. ``shard``
    (a tensor-parallel rank's plan, ``thinker_tp.ThinkerShard``): ``split(target)`` gives the
    (dim, start, stop, full size) a parameter holds of the checkpoint's tensor, ``experts`` the
    routed experts it holds; only those parts are read."""
    if reader.random is not None:
        for target, p in list(module.named_parameters()):
            shape, cut = tuple(p.shape), shard.split(target) if shard is not None else None
            if cut is not None:
                shape = shape[: cut[0]] + (cut[3],) + shape[cut[0] + 1:]
            value = random_tensor(prefix + target, shape, reader.random, device, dtype or p.dtype)
            if cut is not None:
                value = pad_to(value.narrow(cut[0], min(cut[1], cut[3]), max(0, min(cut[2], cut[3]) - cut[1])),
                               cut[0], cut[2] - cut[1])
            _copy(module, target, value, prefix + target, dtype, device)
        module.to(device)
        return
    own = dict(module.named_parameters())
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    done: set[str] = set()
    for name in reader.names(prefix):
        local = name[len(prefix):]
        if local.startswith(skip):
            continue
        m = _EXPERT.match(local)
        if m:
            if shard is None or int(m.group(2)) in shard.experts:  # another rank's expert: not read
                experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = reader.get(name)
            continue
        target = local
        for old, new in ((".experts.gate_up_proj", ".experts.gate_up"), (".experts.down_proj", ".experts.down")):
            if local.endswith(old):
                target = local[: -len(old)] + new
        if target not in own:
            continue  # another part's tensor under this prefix (e.g. the audio tower under thinker.)
        cut = shard.split(target) if shard is not None else None
        _copy(module, target, reader.get(name) if cut is None else reader.part(name, *cut[:3]), name, dtype, device)
        done.add(target)
    for stem, per_expert in experts.items():
        gate_up, down = own.get(stem + ".gate_up"), own.get(stem + ".down")
        if gate_up is None or down is None:
            continue
        held = shard.experts if shard is not None else range(gate_up.shape[0])
        if sorted(per_expert) != list(held) or any(len(v) != 3 for v in per_expert.values()):
            raise CheckpointError(f"{reader.directory}: {prefix}{stem}: expected experts {held.start}..{held.stop - 1} "
                                  "with gate/up/down")
        stacked_gu = torch.stack([torch.cat([per_expert[e]["gate"], per_expert[e]["up"]]) for e in held])
        stacked_d = torch.stack([per_expert[e]["down"] for e in held])
        _copy(module, stem + ".gate_up", stacked_gu, f"{prefix}{stem}.*.gate_proj/up_proj", dtype, device)
        _copy(module, stem + ".down", stacked_d, f"{prefix}{stem}.*.down_proj", dtype, device)
        done.update({stem + ".gate_up", stem + ".down"})
    missing = sorted(set(own) - done)
    if missing:
        raise CheckpointError(f"{reader.directory}: tensors missing for {prefix}*: "
                              + ", ".join(prefix + m for m in missing[:8]) + (" ..." if len(missing) > 8 else ""))
    module.to(device)


def _copy(module: nn.Module, target: str, value: torch.Tensor, name: str, dtype, device) -> None:
    """Replace the parameter (it may live on the meta device: modules are built without memory)."""
    param = module.get_parameter(target)
    if tuple(param.shape) != tuple(value.shape):
        raise CheckpointError(f"tensor {name}: shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    owner, _, leaf = target.rpartition(".")
    data = value.to(device=device, dtype=dtype or param.dtype).contiguous()
    (module.get_submodule(owner) if owner else module).register_parameter(leaf, nn.Parameter(data, requires_grad=False))
