"""Shipped placement layouts: the YAML files under ``models/<model>/configs/``, and the names the
original M*'s docs give layouts (``orpheus_single_gpu``, ``orpheus_pd_disaggregated``, ...).

``--config`` takes a file path, or a layout name: ``<layout>`` of the model being served or
``<model>_<layout>``, where ``<layout>`` is one of our file names (``pd_disaggregated``) or one of
the original's suffixes that maps onto one of ours (``ORIGINAL_SUFFIXES``). A name that maps onto
no file the model ships is an error listing the model's layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mstar.config import ConfigError, load_config
from mstar.models.registry import UnknownModel, configs_dir, default_config_path, known_models

#: the original M*'s layout suffixes -> our layout (file stem). ``single_gpu`` and ``colocated``
#: (everything on one device) name our default only where the default uses one device.
ORIGINAL_SUFFIXES = {"single_gpu": "default", "colocated": "default", "pd_disaggregated": "pd_disaggregated",
                     "cfg_parallel": "cfg_parallel"}
_ONE_DEVICE = ("single_gpu", "colocated")


@dataclass(frozen=True)
class Layout:
    model: str
    name: str  # the file's stem
    path: Path
    devices: int  # distinct device indices (YAML ranks) its node groups use
    aliases: tuple[str, ...]  # the original's names that resolve to it

    def describe(self) -> str:
        also = f"; also {', '.join(self.aliases)}" if self.aliases else ""
        return f"{self.name} ({self.devices} device{'s' if self.devices != 1 else ''}{also})"


def layouts(model: str) -> list[Layout]:
    """The layouts ``model`` ships, by file name."""
    folder = configs_dir(model)  # an unknown name fails with the known ones listed
    found: dict[str, tuple[Path, int]] = {}
    for path in sorted(folder.glob("*.yaml")):
        cfg = load_config(path)
        found[path.stem] = (path, len({r for g in cfg.node_groups for r in g.ranks}))
    out = []
    for stem, (path, devices) in found.items():
        aliases = tuple(f"{model}_{suffix}" for suffix, ours in ORIGINAL_SUFFIXES.items()
                        if ours == stem and (suffix == stem or suffix not in found) and (suffix not in _ONE_DEVICE or devices == 1))
        out.append(Layout(model, stem, path, devices, aliases))
    return out


def _split(name: str, model: str | None) -> tuple[str, str] | None:
    """(model, layout) a layout name stands for; None when it names no known model."""
    models = sorted(known_models(), key=len, reverse=True)  # longest first: 'vjepa2' before a 'vjepa'
    for m in ([model] if model else []) + models:
        if name == m:
            return m, "default"
        if name.startswith(f"{m}_"):
            return m, name[len(m) + 1:]
    return (model, name) if model else None


def looks_like_path(name: str) -> bool:
    return "/" in name or name.endswith((".yaml", ".yml")) or Path(name).is_file()


def resolve(name: str, model: str | None = None) -> Path:
    """The YAML ``--config name`` means; ``model``: the model being served, if known."""
    if looks_like_path(name):
        return Path(name)
    split = _split(name, model)
    if split is None:
        raise ConfigError(f"--config {name}: no such file, and not a layout name (<model>_<layout>) of a known model "
                          f"({', '.join(known_models())}); `mstar models` lists each model's layouts")
    owner, layout = split
    shipped = {lay.name: lay for lay in layouts(owner)}
    if layout in shipped:
        return shipped[layout].path
    for lay in shipped.values():
        if f"{owner}_{layout}" in lay.aliases:
            return lay.path
    why = ""
    if layout in ORIGINAL_SUFFIXES:
        ours = ORIGINAL_SUFFIXES[layout]
        why = (f" (the original M* names a layout so; here it would be {ours}.yaml, which model '{owner}' does not ship"
               + (" as a one-device layout" if layout in _ONE_DEVICE and ours in shipped else "") + ")")
    listed = ", ".join(lay.describe() for lay in shipped.values())
    raise ConfigError(f"--config {name}: model '{owner}' has no layout '{layout}'{why}. Its layouts: {listed}; "
                      f"or pass a YAML file path")


def models_text() -> str:
    """``mstar models``: each model and its layouts."""
    lines = []
    for model in known_models():
        lines.append(model)
        try:
            lines += [f"  {lay.describe()}" for lay in layouts(model)]
        except ConfigError as e:  # a broken shipped YAML says so here, not as a traceback
            lines.append(f"  (layouts unreadable: {e})")
    return "\n".join(lines)


def serve_target(model: str, config: str | None) -> tuple[str, Path]:
    """``mstar serve <model> [--config NAME]`` -> (model, YAML). ``<model>`` may itself be a layout
    name (``mstar serve orpheus_pd_disaggregated``, as the original's docs write it)."""
    if config is not None:
        return model, resolve(config, model)
    if model in known_models():
        return model, default_config_path(model)
    split = _split(model, None)
    if split is None:
        raise UnknownModel(model)
    return split[0], resolve(model)
