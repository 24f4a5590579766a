"""Per-request knobs (``model_kwargs``), checked once on the conductor; errors name the field.

| key | tasks | meaning |
| --- | --- | --- |
| ``task`` | all | ``encode`` (default), ``predict``, ``rollout``, ``plan`` |
| ``stream`` | rollout | emit each predicted frame as it is made (walk ``rollout_streaming``) |
| ``frame_step`` | all | keep every n-th decoded frame (default 1) |
| ``target_ids`` / ``context_ids`` | predict | token indices to predict / to condition on (default: all / the rest) |
| ``actions`` | rollout | ``[T - 1 + H][7]``: the actions between the T context frames, then one per predicted frame |
| ``states`` | rollout, plan | ``[T][7]`` poses of the context frames (plan: one) |
| CEM knobs, ``seed`` | plan | ``cem.CEMConfig`` fields (the reference ``WorldModel``'s defaults) |

A pose / action is xyz, xyz-Euler angles (radians), gripper.
"""

from __future__ import annotations

import math
from typing import Any

from mstar.models.base import InvalidArgument
from mstar.models.knobs import KnobError
from mstar.models.vjepa2.cem import CEMConfig
from mstar.models.vjepa2.knobs import MAX_CEM_STEPS, MAX_SAMPLES, TASKS, VJepa2Request

_INT_KNOBS = {"rollout": (1, 31), "samples": (1, MAX_SAMPLES), "topk": (1, MAX_SAMPLES), "cem_steps": (1, MAX_CEM_STEPS),
              "close_gripper": (0, 31), "seed": (0, 2**63 - 1), "frame_step": (1, 64)}
_FLOAT_KNOBS = {"momentum_mean": (0.0, 1.0), "momentum_std": (0.0, 1.0), "momentum_mean_gripper": (0.0, 1.0),
                "momentum_std_gripper": (0.0, 1.0), "maxnorm": (0.0, 10.0)}
ALLOWED = {"task", "stream", "target_ids", "context_ids", "actions", "states", *_INT_KNOBS, *_FLOAT_KNOBS}


def _int(key: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidArgument(f"model_kwargs.{key}", f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _float(key: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise InvalidArgument(f"model_kwargs.{key}", f"must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def vectors(key: str, v: Any, width: int = 7) -> list[list[float]]:
    """A list of ``width``-number rows (finite)."""
    if not isinstance(v, list) or not v:
        raise InvalidArgument(f"model_kwargs.{key}", f"must be a non-empty list of [{width} numbers] rows")
    for i, row in enumerate(v):
        if not isinstance(row, list) or len(row) != width:
            n = len(row) if isinstance(row, list) else type(row).__name__
            raise InvalidArgument(f"model_kwargs.{key}", f"row {i} must have {width} numbers (xyz, xyz-Euler angles, "
                                                         f"gripper), got {n}")
        if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in row):
            raise InvalidArgument(f"model_kwargs.{key}", f"row {i} must hold finite numbers")
    return v


def ids(key: str, v: Any) -> list[int]:
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise InvalidArgument(f"model_kwargs.{key}", "must be a non-empty list of non-negative token indices")
    if len(set(v)) != len(v):
        raise InvalidArgument(f"model_kwargs.{key}", "repeats a token index")
    return v


def validate(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The request's knobs as given (their types and ranges checked by ``VJepa2Request``), with
    what a type cannot say checked too; defaults are filled where each task uses them."""
    try:
        VJepa2Request.parse(kwargs, model="vjepa2", sep=": ")
    except KnobError as e:
        raise InvalidArgument(e.key, e.description) from None
    out: dict[str, Any] = {}
    for key, v in kwargs.items():
        if key not in ALLOWED:
            raise InvalidArgument(f"model_kwargs.{key}", f"unknown key; allowed: {', '.join(sorted(ALLOWED))}")
        if key in _INT_KNOBS:
            out[key] = _int(key, v, *_INT_KNOBS[key])
        elif key in _FLOAT_KNOBS:
            out[key] = _float(key, v, *_FLOAT_KNOBS[key])
        elif key == "task":
            if v not in TASKS:
                raise InvalidArgument("model_kwargs.task", f"must be one of {', '.join(TASKS)}, got {v!r}")
            out[key] = v
        elif key == "stream":
            if not isinstance(v, bool):
                raise InvalidArgument("model_kwargs.stream", "must be true or false")
            out[key] = v
        elif key in ("actions", "states"):
            out[key] = vectors(key, v)
        else:
            out[key] = ids(key, v)
    out.setdefault("task", "encode")
    if out["task"] == "plan":
        try:
            CEMConfig(**{k: out[k] for k in CEMConfig.knobs() if k in out})
        except ValueError as e:
            raise InvalidArgument("model_kwargs.topk", str(e)) from None
    return out
