"""Model registry. Models import lazily, so serving one model never needs another's
dependencies."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the gateway reads request schemas from here without importing torch
    from mstar.models.base import Model

# name -> "module:Class"
_REGISTRY: dict[str, str] = {
    "toy": "mstar.models.toy.model:ToyModel",
    "orpheus": "mstar.models.orpheus.model:OrpheusModel",
    "vjepa2": "mstar.models.vjepa2.model:VJepa2Model",
    "pi05": "mstar.models.pi05.model:Pi05Model",
    "bagel": "mstar.models.bagel.model:BagelModel",
    "qwen3_omni": "mstar.models.qwen3_omni.model:Qwen3OmniModel",
}

# name -> "module:Class" of its request knobs (mstar.models.knobs.Knobs; no torch imported):
# the gateway's OpenAPI document shows them; each is its model class's ``request_schema``
_REQUEST_SCHEMAS: dict[str, str] = {
    "toy": "mstar.models.toy.knobs:ToyRequest",
    "orpheus": "mstar.models.orpheus.knobs:OrpheusRequest",
    "pi05": "mstar.models.pi05.knobs:Pi05Request",
    "vjepa2": "mstar.models.vjepa2.knobs:VJepa2Request",
    "bagel": "mstar.models.bagel.schema:BagelRequest",
    "qwen3_omni": "mstar.models.qwen3_omni.knobs:OmniRequest",
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


def register(name: str, target: str, request_schema: str | None = None) -> None:
    """Register an out-of-tree model: ``target`` is "module:Class"; ``request_schema``
    "module:Class" of its request knobs, if it has typed ones."""
    _REGISTRY[name] = target
    if request_schema is not None:
        _REQUEST_SCHEMAS[name] = request_schema


def _load(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def request_schemas() -> dict[str, Any]:
    """Model name -> its request knobs class, for the models that declare one."""
    return {name: _load(target) for name, target in sorted(_REQUEST_SCHEMAS.items())}


def model_class(name: str) -> type[Model]:
    target = _REGISTRY.get(name)
    if target is None:
        raise UnknownModel(name)
    return _load(target)


def create_model(name: str, model_kwargs: dict[str, Any] | None = None, cache_dir: str | None = None) -> Model:
    return model_class(name)(model_kwargs, cache_dir)


def configs_dir(name: str) -> Path:
    """Where the model's shipped placement YAMLs live (``models/<name>/configs``)."""
    model_class(name)  # unknown names fail with the list of known ones
    return _MODELS_DIR / name / "configs"


def default_config_path(name: str) -> Path:
    """The model's default placement YAML (``models/<name>/configs/default.yaml``)."""
    path = configs_dir(name) / "default.yaml"
    if not path.exists():
        raise FileNotFoundError(f"model '{name}' ships no default config at {path}; pass --config")
    return path
