"""Shared fixtures: the model's own tiny random checkpoint (the official layout; the weights the
stored reference outputs were made from), the reference's recorded outputs, and our whole-request
pipeline over that checkpoint in fp32 with the small image limits the reference run used."""

import json
from pathlib import Path

import pytest
import torch
from bagel_checks import DATA


@pytest.fixture(scope="session")
def bagel_cache(tmp_path_factory):
    """A --cache-dir holding ByteDance-Seed/BAGEL-7B-MoT as the model writes it for --random-weights."""
    from mstar.models.registry import create_model

    d = tmp_path_factory.mktemp("bagel-weights")
    assert create_model("bagel", {}, str(d)).write_random_weights(str(d))
    return str(d)


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint alone (``write_random_weights`` writes this one: demo.write_checkpoint, seed 0)."""
    from mstar.models.bagel.demo import write_checkpoint

    d = tmp_path_factory.mktemp("bagel-tiny")
    write_checkpoint(d, seed=0)
    return d


@pytest.fixture(scope="session")
def reference():
    """(tensors, metadata) recorded from the reference implementation (data/README.md)."""
    from safetensors.torch import load_file

    return load_file(str(DATA / "bagel_reference.safetensors")), json.loads((DATA / "bagel_reference.json").read_text())


@pytest.fixture(scope="session")
def pipeline(ckpt_dir, reference):
    from mstar.models.bagel.media import Fit
    from mstar.models.bagel.pipeline import BagelPipeline

    meta = reference[1]
    torch.manual_seed(0)
    return BagelPipeline(ckpt_dir, vae_fit=Fit(*meta["vae_fit"]), vit_fit=Fit(*meta["vit_fit"]))


