"""π0.5's knobs, typed: the placement's ``model_kwargs`` (``Pi05Settings``) and a request's
(``Pi05Request``). Imports no torch (the gateway's OpenAPI document reads them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.models.knobs import Knobs

MAX_STATE_DIM = 32  # the action expert's width: a robot reports at most this many state values


class Pi05Settings(Knobs):
    """Deployment knobs (YAML ``model_kwargs``)."""

    checkpoint: str = Field("lerobot/pi05_base", description="checkpoint (hub id or directory)")
    action_horizon: int | None = Field(None, ge=1, le=256, description="actions per chunk (default: the checkpoint's, 50)")
    num_steps: int = Field(10, ge=1, le=100, description="Euler steps of the flow")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="default: bfloat16 on CUDA")
    compile: bool | None = Field(None, description="vision, prefix and expert step under torch.compile inside "
                                 "their CUDA graphs (default: on a GPU; never on a CPU)")


class Pi05Request(Knobs):
    """A request's ``model_kwargs``: the robot's state (one value per dimension it reports, in its
    own units: normalised with the checkpoint's statistics) and the noise seed."""

    state: list[float] = Field(..., min_length=1, max_length=MAX_STATE_DIM,
                               description="the robot's state, as it reports it")
    seed: int | None = Field(None, ge=0, lt=2**63, description="noise seed; None: random")
