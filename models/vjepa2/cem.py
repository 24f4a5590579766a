"""Planning by the cross-entropy method over action-conditioned rollouts, as the reference
``WorldModel.infer_next_action`` / ``cem`` do it (defaults: theirs).

Each iteration samples ``samples`` trajectories from N(mean, std) per step (xyz clipped to
+-maxnorm, gripper to +-0.75, rotation 0), rolls every one through the world model (a batched
rollout), scores each by the mean L1 distance of its final frame to the goal, keeps the ``topk``
best and moves mean / std toward theirs with momentum. The answer is the mean trajectory with
small gripper values rounded to 0. The sampling noise can be injected (tests; reproducible plans).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class CEMConfig:
    rollout: int = 2  # steps per trajectory
    samples: int = 400
    topk: int = 10
    cem_steps: int = 10
    momentum_mean: float = 0.15
    momentum_std: float = 0.15
    momentum_mean_gripper: float = 0.15
    momentum_std_gripper: float = 0.15
    maxnorm: float = 0.05
    close_gripper: int | None = None  # steps from this one on: gripper action 1

    def __post_init__(self) -> None:
        if not 1 <= self.topk <= self.samples:
            raise ValueError(f"topk must be in [1, samples={self.samples}], got {self.topk}")

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def initial(cfg: CEMConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """mean ``[rollout, 4]`` zeros; std ``[rollout, 4]`` (maxnorm x3, 1) - over xyz and gripper."""
    mean = torch.zeros(cfg.rollout, 4, device=device)
    std = torch.cat([torch.full((cfg.rollout, 3), cfg.maxnorm, device=device), torch.ones(cfg.rollout, 1, device=device)], -1)
    return mean, std


def sample(cfg: CEMConfig, mean: torch.Tensor, std: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``noise`` ``[rollout, samples, 4]`` standard normal -> actions ``[samples, rollout, 7]``."""
    x = noise * std.unsqueeze(1) + mean.unsqueeze(1)  # [H, S, 4]
    xyz = x[..., :3].clamp(-cfg.maxnorm, cfg.maxnorm)
    grip = x[..., 3:].clamp(-0.75, 0.75)
    if cfg.close_gripper is not None:
        late = torch.arange(cfg.rollout, device=x.device) >= cfg.close_gripper
        grip = torch.where(late[:, None, None], torch.ones_like(grip), grip)
    actions = torch.cat([xyz, torch.zeros_like(xyz), grip], -1)
    return actions.transpose(0, 1).contiguous()


def energy(final: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    """Mean L1 of each sample's final frame ``[S, P, E]`` to the goal ``[P, E]``: ``[S]``."""
    return (final.flatten(1) - goal.reshape(1, -1)).abs().mean(-1)


def update(cfg: CEMConfig, mean: torch.Tensor, std: torch.Tensor, actions: torch.Tensor, energies: torch.Tensor,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new (mean, std) and the indices of the top-k (lowest energy) samples."""
    top = energies.topk(cfg.topk, largest=False).indices
    chosen = actions[top]  # [k, H, 7]
    m = chosen.mean(0)
    s = chosen.std(0)
    keep = lambda new, old, mom: new * (1.0 - mom) + old * mom  # noqa: E731
    mean = torch.cat([keep(m[:, :3], mean[:, :3], cfg.momentum_mean),
                      keep(m[:, 6:], mean[:, 3:], cfg.momentum_mean_gripper)], -1)
    std = torch.cat([keep(s[:, :3], std[:, :3], cfg.momentum_std),
                     keep(s[:, 6:], std[:, 3:], cfg.momentum_std_gripper)], -1)
    return mean, std, top


def final_action(mean: torch.Tensor) -> torch.Tensor:
    """The plan ``[rollout, 7]``: mean xyz, zero rotation, gripper with |g| < 0.25 set to 0."""
    grip = mean[:, 3:]
    grip = torch.where(grip.abs() < 0.25, torch.zeros_like(grip), grip)
    return torch.cat([mean[:, :3], torch.zeros_like(mean[:, :3]), grip], -1)


#: rolls actions [S, H, 7] from the context to the final frames [S, P, E]
WorldModel = Callable[[torch.Tensor], torch.Tensor]


def plan(cfg: CEMConfig, world_model: WorldModel, goal: torch.Tensor, noise: torch.Tensor | None = None,
         generator: torch.Generator | None = None, trace: list | None = None) -> torch.Tensor:
    """The planned trajectory ``[rollout, 7]``. ``noise`` ``[cem_steps, rollout, samples, 4]``
    replaces the random draws; ``trace`` (a list) gets ``(energies, top-k)`` per iteration."""
    mean, std = initial(cfg, goal.device)
    for it in range(cfg.cem_steps):
        # drawn on the host (``generator`` is a host one), as the served plan walk draws them: the
        # same seed plans alike on any device
        n = noise[it] if noise is not None else torch.randn((cfg.rollout, cfg.samples, 4), generator=generator)
        actions = sample(cfg, mean, std, n.to(mean.device))
        energies = energy(world_model(actions), goal)
        mean, std, top = update(cfg, mean, std, actions, energies.to(mean.dtype))
        if trace is not None:
            trace.append((energies, top))
    return final_action(mean)
