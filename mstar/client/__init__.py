"""The M* Python SDK: ``MStarClient`` (blocking) and ``AsyncMStarClient`` (asyncio), over the
REST gateway (``http://``) or the conductor's gRPC API (``grpc://``), with typed errors."""

from mstar.client.aio import AsyncGenerateStream, AsyncMStarClient
from mstar.client.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    MStarError,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from mstar.client.messages import prompt_from_messages
from mstar.client.robot import Plan, Rollout, RolloutStep
from mstar.client.sync import GenerateStream, MStarClient
from mstar.client.types import (
    Chunk,
    File,
    Final,
    Health,
    Image,
    Modality,
    ModelInfo,
    Output,
    Result,
    Speech,
    Tensor,
    Timings,
    Usage,
)

__all__ = [
    "MStarClient", "AsyncMStarClient", "GenerateStream", "AsyncGenerateStream",
    "MStarError", "InvalidArgument", "NotFound", "AlreadyExists", "ResourceExhausted", "Cancelled", "Unavailable",
    "DeadlineExceeded", "Internal", "Unauthenticated",
    "Chunk", "File", "Final", "Health", "Image", "Modality", "ModelInfo", "Output", "Result", "Speech", "Tensor",
    "Timings", "Usage", "prompt_from_messages", "Plan", "Rollout", "RolloutStep",
]
