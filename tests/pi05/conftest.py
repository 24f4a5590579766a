"""Shared fixtures: the model's own tiny random checkpoint (the real layout; the same weights the
stored reference outputs were made from), and the policy loaded from it in fp32."""

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def pi05_cache(tmp_path_factory):
    """A --cache-dir holding lerobot/pi05_base as the model writes it for --random-weights."""
    from mstar.models.registry import create_model

    d = tmp_path_factory.mktemp("pi05-weights")
    assert create_model("pi05", {}, str(d)).write_random_weights(str(d))
    return str(d)


@pytest.fixture(scope="session")
def ckpt_dir(pi05_cache) -> Path:
    return Path(pi05_cache) / "lerobot" / "pi05_base"


@pytest.fixture(scope="session")
def policy(ckpt_dir):
    from mstar.models.pi05.weights import load_policy

    torch.manual_seed(0)
    return load_policy(ckpt_dir)
