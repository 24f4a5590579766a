"""The SDK's robot calls, shared by the sync and asyncio clients: a policy's ``act`` (π0.5) and a world
model's ``encode`` / ``rollout`` / ``plan`` (V-JEPA 2): their requests built from numpy arrays, bytes
or paths, their results read back as numpy arrays.

The V-JEPA 2 calls are ``generate`` with the model's knobs (models/vjepa2/requests.py) and read its
outputs by name: ``latents``, ``frames`` and ``poses`` (one chunk per step when streamed), ``action``
and ``energies``. A pose or action row is xyz, xyz-Euler angles (radians), gripper.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mstar.client.errors import Internal, InvalidArgument
from mstar.client.types import Chunk, File, FileLike, Result, normalize_files

#: a clip or frames: an encoded video / image file (path or bytes), or an array: uint8 ``[T, H, W, 3]``
#: (or one ``[H, W, 3]`` image), resized and cropped by the server, or normalised float ``[T, 3, crop, crop]``
VideoLike = str | os.PathLike | bytes | np.ndarray


@dataclass(frozen=True)
class ActParams:
    """One policy request (conductor.proto's ActRequest), transport-neutral."""

    model: str
    task: str
    images: tuple[File, ...]
    #: the robot's state in its own units, one value per dimension
    state: tuple[float, ...]
    seed: int | None = None
    #: seconds; 0 leaves the server's default in force
    timeout_s: float = 0.0
    request_id: str = ""

    @property
    def model_kwargs(self) -> dict:
        """The same request as ``generate``'s knobs (the REST form)."""
        return {"state": list(self.state), **({} if self.seed is None else {"seed": self.seed})}


def act_params(model: str, task: str, images: Mapping[str, FileLike], state: Sequence[float], seed: int | None,
               timeout: float | None, request_id: str | None) -> ActParams:
    if not isinstance(task, str):
        raise InvalidArgument("task", f"task: must be a string, got {type(task).__name__}")
    if not isinstance(images, Mapping):
        raise InvalidArgument("images", "images: must map camera name -> image bytes, path or File, e.g. "
                                        "{'base_0_rgb': 'cam.png'}")
    try:
        values = np.asarray(state, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidArgument("state", f"state: must be a sequence of numbers, got {state!r}"[:200]) from None
    if values.ndim != 1:
        raise InvalidArgument("state", f"state: must be one row of numbers, got shape {list(values.shape)}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise InvalidArgument("seed", f"seed: must be an integer in [0, 2**63), got {seed!r}")
    return ActParams(model, task, normalize_files(images), tuple(values.tolist()), seed, float(timeout or 0.0),
                     request_id or "")


def video_file(name: str, video: VideoLike) -> File:
    """An array travels as ``.npy`` (the server reads it without a decoder); a file as it is."""
    if isinstance(video, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(video), allow_pickle=False)
        return File(name, buf.getvalue(), "application/x-npy", f"{name}.npy")
    if isinstance(video, str | os.PathLike | bytes | bytearray):
        return normalize_files({name: video})[0]
    raise InvalidArgument(name, f"{name}: must be a numpy array, bytes or a path, got {type(video).__name__}")


def rows(field: str, value: object, width: int = 7) -> list[list[float]]:
    """An array-like of ``[n, width]`` finite numbers as JSON lists (a single row is one row)."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidArgument(field, f"{field}: must be rows of {width} numbers") from None
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[1] != width or not arr.shape[0]:
        raise InvalidArgument(field, f"{field}: must be rows of {width} numbers (xyz, xyz-Euler angles, gripper), "
                                     f"got shape {list(np.shape(value))}")
    if not all(math.isfinite(x) for x in arr.flat):
        raise InvalidArgument(field, f"{field}: must hold finite numbers")
    return arr.tolist()


def tensor_of(result: Result, name: str) -> np.ndarray:
    """Output ``name``'s tensors, joined along dim 0 when it came in several chunks; a writable array."""
    out = result.outputs.get(name)
    tensors = out.tensors if out is not None else []
    if not tensors:
        raise Internal(f"the result has no '{name}' tensor; outputs: {', '.join(result.outputs) or 'none'}",
                       request_id=result.request_id)
    arrays = [t.numpy() for t in tensors]
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0].copy()


@dataclass(frozen=True)
class Rollout:
    """A world-model rollout: the predicted frames' latents ``[steps, tokens, dim]`` and the poses ``[steps, 7]``."""

    frames: np.ndarray
    poses: np.ndarray
    result: Result


@dataclass(frozen=True)
class RolloutStep:
    """One predicted step of a streamed rollout: its latents ``[tokens, dim]`` and pose ``[7]``."""

    index: int
    frame: np.ndarray
    pose: np.ndarray


@dataclass(frozen=True)
class Plan:
    """A planning answer: the action trajectory ``[rollout, 7]`` (CEM's mean: rotation 0, a gripper value
    below 0.25 in size set to 0) and the last iteration's top-k energies (mean L1 to the goal)."""

    actions: np.ndarray
    energies: np.ndarray
    result: Result


def rollout_of(result: Result) -> Rollout:
    return Rollout(tensor_of(result, "frames"), tensor_of(result, "poses"), result)


def plan_of(result: Result) -> Plan:
    return Plan(tensor_of(result, "action"), tensor_of(result, "energies"), result)


class StepPairer:
    """Streamed ``frames`` and ``poses`` chunks -> RolloutSteps, each once both of its index arrived."""

    def __init__(self) -> None:
        self._half: dict[int, dict[str, np.ndarray]] = {}

    def add(self, chunk: Chunk) -> Iterator[RolloutStep]:
        if chunk.name not in ("frames", "poses") or chunk.tensor is None:
            return
        arr = chunk.tensor.numpy()
        half = self._half.setdefault(chunk.index, {})
        half[chunk.name] = arr[0] if arr.ndim and arr.shape[0] == 1 else arr
        if len(half) == 2:
            del self._half[chunk.index]
            yield RolloutStep(chunk.index, half["frames"].copy(), half["poses"].copy())


def rollout_request(frames: VideoLike, actions: object, states: object) -> tuple[dict[str, File], dict]:
    return {"frames": video_file("frames", frames)}, {"task": "rollout", "actions": rows("actions", actions),
                                                      "states": rows("states", states)}


def plan_request(frame: VideoLike, goal: VideoLike, state: object, knobs: dict) -> tuple[dict[str, File], dict]:
    files = {"frame": video_file("frame", frame), "goal": video_file("goal", goal)}
    return files, {"task": "plan", "states": rows("state", state), **knobs}
