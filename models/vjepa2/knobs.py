"""V-JEPA 2's knobs, typed: the placement's ``model_kwargs`` (``VJepa2Settings``) and a request's
(``VJepa2Request``; requests.py adds what a type cannot say: rows of 7, unique token ids, CEM
consistency). Imports no torch (the gateway's OpenAPI document reads them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.models.knobs import Knobs

TASKS = ("encode", "predict", "rollout", "plan")
MAX_CEM_STEPS = 100
MAX_SAMPLES = 4096


class VJepa2Settings(Knobs):
    """Deployment knobs (YAML ``model_kwargs``)."""

    checkpoint: str = Field("facebook/vjepa2-vitl-fpc64-256", description="encoder + masked predictor checkpoint")
    ac_checkpoint: str = Field("facebook/vjepa2-ac-vitg", description="action-conditioned predictor checkpoint")
    attention: str | None = Field(
        None, pattern=r"^sdpa(:(cudnn|flash|efficient|math)(,(cudnn|flash|efficient|math))*)?$",
        description="the encoders' attention: sdpa (torch's kernel choice) or sdpa:<kernels> in that order "
                    "(e.g. sdpa:cudnn,flash)")
    compile: bool | None = Field(None, description="the blocks' fused kernels: Triton's RoPE, torch.compile "
                                 "(default: on a GPU; never on a CPU)")
    cuda_graphs: bool = Field(True, description="rollout steps as CUDA graphs")
    max_rollout_rows: int = Field(512, ge=1, le=65536, description="rollout rows batched at once")


class VJepa2Request(Knobs):
    """A request's ``model_kwargs`` (see requests.py for each task's meaning)."""

    task: Literal[TASKS] = Field("encode", description="encode, predict, rollout or plan")  # type: ignore[valid-type]
    stream: bool = Field(False, description="rollout: emit each predicted frame as it is made")
    frame_step: int = Field(1, ge=1, le=64, description="keep every n-th decoded frame")
    target_ids: list[int] | None = Field(None, description="predict: token indices to predict")
    context_ids: list[int] | None = Field(None, description="predict: token indices to condition on")
    actions: list[list[float]] | None = Field(None, description="rollout: [T - 1 + H][7] actions")
    states: list[list[float]] | None = Field(None, description="rollout, plan: [T][7] poses")
    rollout: int = Field(2, ge=1, le=31, description="plan: steps per trajectory")
    samples: int = Field(400, ge=1, le=MAX_SAMPLES, description="plan: trajectories per CEM iteration")
    topk: int = Field(10, ge=1, le=MAX_SAMPLES, description="plan: elite trajectories kept")
    cem_steps: int = Field(10, ge=1, le=MAX_CEM_STEPS, description="plan: CEM iterations")
    close_gripper: int | None = Field(None, ge=0, le=31, description="plan: steps from this one on close the gripper")
    seed: int | None = Field(None, ge=0, lt=2**63, description="plan: sampling seed")
    momentum_mean: float = Field(0.15, ge=0, le=1)
    momentum_std: float = Field(0.15, ge=0, le=1)
    momentum_mean_gripper: float = Field(0.15, ge=0, le=1)
    momentum_std_gripper: float = Field(0.15, ge=0, le=1)
    maxnorm: float = Field(0.05, ge=0, le=10, description="plan: largest xyz action")
