"""Action-conditioned rollouts on a persistent K/V cache.

Attention in the AC predictor is block-causal by frame, so a frame's K/V never change once it has
been fed: a rollout keeps one cache per sample and each step feeds only the new frame's
2 + 256 tokens. The cache is one static buffer of every frame the rollout will feed
(context frames - 1 + steps); step ``t`` writes slot t and attends to slots [0, t] exactly: the
slice length is a host integer, so an unrolled loop of steps has fixed shapes per step and the
whole rollout captures as one CUDA graph (``services/engines/loop_graph.py``: the loop's iteration
index is a Python int frozen into the graph). No frame mask over a full buffer: that would make
every step attend over all H + 1 frames, about twice the attention work of a 30-step rollout.

Predicted frames are layer-normed without affine before they are fed back (the reference
``WorldModel`` normalises its representations), and poses follow ``pose.new_pose`` on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar.models.vjepa2.modules import ACPredictor, KVCache
from mstar.models.vjepa2.pose import new_pose


def normalize(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],))


@dataclass
class Rollout:
    """One batch of rollouts in progress: the cache and where it stands."""

    cache: KVCache
    frame: torch.Tensor  # [B, P, E]: the frame the next step feeds
    pose: torch.Tensor  # [B, 7]: its pose
    t: int  # its index (frames fed so far)


def start(pred: ACPredictor, context: torch.Tensor, actions: torch.Tensor, states: torch.Tensor, steps: int) -> Rollout:
    """Feed the context frames but the last (their K/V into the cache). ``context`` ``[B, T, P, E]``
    (normalised encoder tokens), ``actions`` ``[B, >= T - 1, 7]`` (the actions between context
    frames come first), ``states`` ``[B, T, 7]``."""
    T = context.shape[1]
    cache = pred.new_cache(context.shape[0], T - 1 + steps)
    for t in range(T - 1):
        pred.step(context[:, t], actions[:, t], states[:, t], cache, t)
    return Rollout(cache, context[:, T - 1], states[:, T - 1], T - 1)


def advance(pred: ACPredictor, r: Rollout, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: feed ``r.frame`` with ``action`` ``[B, 7]``; the next frame and pose (kept in ``r``)."""
    frame = normalize(pred.step(r.frame, action, r.pose, r.cache, r.t))
    pose = new_pose(r.pose, action.to(r.pose.dtype))
    r.frame, r.pose, r.t = frame, pose, r.t + 1
    return frame, pose


def advance_many(pred: ACPredictor, rs: list[Rollout], actions: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``advance`` for several rollouts (requests) in one batched step; each at its own frame."""
    if len(rs) == 1:
        return [advance(pred, rs[0], actions[0])]
    action = torch.cat(actions)
    out = normalize(pred.step_many(torch.cat([r.frame for r in rs]), action, torch.cat([r.pose for r in rs]),
                                   [(r.cache, r.t) for r in rs]))
    poses = new_pose(torch.cat([r.pose for r in rs]), action.to(rs[0].pose.dtype))
    result, row = [], 0
    for r in rs:
        n = r.frame.shape[0]
        r.frame, r.pose, r.t = out[row:row + n], poses[row:row + n], r.t + 1
        result.append((r.frame, r.pose))
        row += n
    return result


def rollout(pred: ACPredictor, context: torch.Tensor, actions: torch.Tensor, states: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every predicted frame and pose: ``[B, H, P, E]``, ``[B, H, 7]`` with H = actions - (T - 1)."""
    T = context.shape[1]
    steps = actions.shape[1] - (T - 1)
    r = start(pred, context, actions, states, steps)
    frames, poses = [], []
    for h in range(steps):
        f, p = advance(pred, r, actions[:, T - 1 + h])
        frames.append(f)
        poses.append(p)
    return torch.stack(frames, 1), torch.stack(poses, 1)


class RolloutBody:
    """A rollout from one context frame as a fixed-count loop body for ``LoopGraphs``: inputs
    ``frame`` ``[B, P, E]`` and ``pose`` ``[B, 7]`` (carried), ``actions`` ``[B, H, 7]`` (constant);
    the cache is made at iteration 0 and lives until the loop's end (inside a captured graph: in
    its memory pool). The last iteration's ``frame`` / ``pose`` are the rollout's end."""

    def __init__(self, pred: ACPredictor, steps: int):
        self.pred, self.steps = pred, steps
        self._cache: KVCache | None = None

    def __call__(self, inputs: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        frame, pose, actions = inputs["frame"], inputs["pose"], inputs["actions"]
        if i == 0:
            self._cache = self.pred.new_cache(frame.shape[0], self.steps, dtype=frame.dtype)
        assert self._cache is not None
        out = normalize(self.pred.step(frame, actions[:, i], pose, self._cache, i))
        nxt = new_pose(pose, actions[:, i].to(pose.dtype))
        if i == self.steps - 1:
            self._cache = None  # eager: freed with the loop; a graph keeps its pool
        return {"frame": out, "pose": nxt}
