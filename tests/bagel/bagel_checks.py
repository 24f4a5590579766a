"""What BAGEL's tests share (a module of its own name: `conftest` is ambiguous across test folders)."""

from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
