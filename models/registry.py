"""Model registry. Models import lazily, so serving one model never needs another's
dependencies."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from mstar.models.base import Model

# name -> "module:Class"
_REGISTRY: dict[str, str] = {
    "toy": "mstar.models.toy.model:ToyModel",
    "orpheus": "mstar.models.orpheus.model:OrpheusModel",
    "vjepa2": "mstar.models.vjepa2.model:VJepa2Model",
    "pi05": "mstar.models.pi05.model:Pi05Model",
}

_MODELS_DIR = Path(__file__).resolve().parent


class UnknownModel(KeyError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"Unknown model '{self.name}'. Known: {', '.join(known_models())}"


def known_models() -> list[str]:
    return sorted(_REGISTRY)


def register(name: str, target: str) -> None:
    """Register an out-of-tree model: ``target`` is "module:Class"."""
    _REGISTRY[name] = target


def model_class(name: str) -> type[Model]:
    target = _REGISTRY.get(name)
    if target is None:
        raise UnknownModel(name)
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def create_model(name: str, model_kwargs: dict[str, Any] | None = None, cache_dir: str | None = None) -> Model:
    return model_class(name)(model_kwargs, cache_dir)


def default_config_path(name: str) -> Path:
    """The model's default placement YAML (``models/<name>/configs/default.yaml``)."""
    model_class(name)  # unknown names fail with the list of known ones
    path = _MODELS_DIR / name / "configs" / "default.yaml"
    if not path.exists():
        raise FileNotFoundError(f"model '{name}' ships no default config at {path}; pass --config")
    return path
