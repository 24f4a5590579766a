"""Normalisation statistics of a π0.5 checkpoint directory, as lerobot or openpi store them.

- lerobot (``lerobot/pi05_base`` and its fine-tunes): ``policy_preprocessor.json`` lists a
  ``normalizer_processor`` step whose ``state_file`` (``policy_preprocessor_step_N_normalizer_processor.safetensors``)
  holds flat ``{feature}.{stat}`` tensors (``observation.state.q01`` ...), its ``config.norm_map`` the
  mode per feature type (π0.5: ``QUANTILES`` for STATE and ACTION); ``policy_postprocessor.json``'s
  ``unnormalizer_processor`` step holds ``action.*``. Quantiles: 2 (x - q01) / (q99 - q01) - 1.
- openpi: ``norm_stats.json`` (also under ``assets/<asset_id>/``), ``{"norm_stats": {"state": {...},
  "actions": {...}}}`` with ``mean``, ``std``, ``q01``, ``q99``; π0.5 uses quantiles:
  (x - q01) / (q99 - q01 + 1e-6) * 2 - 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Normalizer:
    """One feature's statistics and mode (QUANTILES, QUANTILE10, MEAN_STD, MIN_MAX, IDENTITY)."""

    mode: str
    stats: dict[str, np.ndarray]
    eps: float = 1e-8  # lerobot: replaces a zero denominator
    add: float = 0.0  # openpi: added to the quantile range

    @property
    def dim(self) -> int:
        return len(next(iter(self.stats.values()))) if self.stats else 0

    def _lo_range(self) -> tuple[np.ndarray, np.ndarray]:
        lo_hi = {"QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90"), "MIN_MAX": ("min", "max")}[self.mode]
        lo, hi = (self.stats[k] for k in lo_hi)
        denom = hi - lo + self.add
        return lo, np.where(denom == 0, self.eps, denom)

    def normalize(self, x: np.ndarray) -> np.ndarray:
        if self.mode == "IDENTITY":
            return x
        if self.mode == "MEAN_STD":
            return (x - self.stats["mean"]) / (self.stats["std"] + self.eps)
        lo, denom = self._lo_range()
        return 2.0 * (x - lo) / denom - 1.0

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        if self.mode == "IDENTITY":
            return x
        if self.mode == "MEAN_STD":
            return x * (self.stats["std"] + self.eps) + self.stats["mean"]
        lo, denom = self._lo_range()
        return (x + 1.0) * denom / 2.0 + lo


@dataclass(frozen=True)
class NormStats:
    state: Normalizer | None
    action: Normalizer | None
    source: str


def _lerobot(directory: Path, pipeline: str, registry: str, feature: str, kind: str) -> Normalizer | None:
    from safetensors.numpy import load_file

    path = directory / f"{pipeline}.json"
    if not path.is_file():
        return None
    for step in json.loads(path.read_text()).get("steps", []):
        if step.get("registry_name") != registry or not step.get("state_file"):
            continue
        flat = load_file(str(directory / step["state_file"]))
        stats = {k.rsplit(".", 1)[1]: v.astype(np.float64) for k, v in flat.items() if k.rsplit(".", 1)[0] == feature}
        if not stats:
            return None
        cfg = step.get("config", {})
        mode = cfg.get("norm_map", {}).get(kind, "QUANTILES")
        return Normalizer(mode, stats, eps=float(cfg.get("eps", 1e-8)))
    return None


def load_norm_stats(directory: str | Path) -> NormStats | None:
    """The checkpoint's statistics (lerobot's processor files first, then openpi's norm_stats.json), or None."""
    directory = Path(directory)
    state = _lerobot(directory, "policy_preprocessor", "normalizer_processor", "observation.state", "STATE")
    action = _lerobot(directory, "policy_postprocessor", "unnormalizer_processor", "action", "ACTION")
    if state is not None or action is not None:
        return NormStats(state, action, "lerobot")
    for path in [directory / "norm_stats.json", *sorted(directory.glob("assets/*/norm_stats.json"))]:
        if path.is_file():
            data = json.loads(path.read_text())["norm_stats"]
            make = lambda d: Normalizer("QUANTILES", {k: np.asarray(v, np.float64) for k, v in d.items()},  # noqa: E731
                                        add=1e-6) if d else None
            return NormStats(make(data.get("state")), make(data.get("actions")), str(path))
    return None


def write_lerobot_stats(directory: str | Path, state: dict[str, np.ndarray], action: dict[str, np.ndarray]) -> None:
    """Statistics in lerobot's processor layout (tests, demo checkpoints)."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    for pipeline, registry, feature, stats in (
            ("policy_preprocessor", "normalizer_processor", "observation.state", state),
            ("policy_postprocessor", "unnormalizer_processor", "action", action)):
        state_file = f"{pipeline}_step_0_{registry}.safetensors"
        save_file({f"{feature}.{k}": np.asarray(v, np.float32) for k, v in stats.items()}, str(directory / state_file))
        step = {"registry_name": registry, "state_file": state_file,
                "config": {"eps": 1e-8, "norm_map": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}}}
        (directory / f"{pipeline}.json").write_text(json.dumps({"name": pipeline, "steps": [step]}, indent=1))
