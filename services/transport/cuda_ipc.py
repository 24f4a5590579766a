"""CUDA IPC transport (work in progress: availability only so far)."""

from __future__ import annotations


def available() -> bool:
    import torch

    return torch.cuda.is_available()
