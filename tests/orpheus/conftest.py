"""Shared fixtures: a tiny random reference `snac.SNAC` on disk, one demo checkpoint, and the
model's own random weights (read-only: every mesh test of the session serves them)."""

import json
from pathlib import Path

import pytest
import torch

# Same family as hubertsiuzdak/snac_24khz (rates, strides, codebook, no attention), tiny channels.
TINY_SNAC = {
    "sampling_rate": 24000, "encoder_dim": 4, "encoder_rates": [2, 4, 8, 8], "decoder_dim": 64,
    "decoder_rates": [8, 8, 4, 2], "attn_window_size": None, "codebook_size": 4096,
    "codebook_dim": 8, "vq_strides": [4, 2, 1], "noise": True, "depthwise": True,
}


@pytest.fixture(scope="session")
def reference_snac(tmp_path_factory):
    """(snac.SNAC in eval mode, directory with its config.json + pytorch_model.bin).

    Weight-norm gains and Snake alphas are perturbed away from their init (g = ||v||, alpha = 1),
    so a loader that ignored either would not match the reference.
    """
    import snac

    torch.manual_seed(1234)
    model = snac.SNAC(**TINY_SNAC).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("original0", "alpha")):
                tensor.mul_(0.5 + torch.rand_like(tensor))
    directory: Path = tmp_path_factory.mktemp("snac_ref")
    (directory / "config.json").write_text(json.dumps(TINY_SNAC))
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return model, directory


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    from mstar.models.orpheus.demo_checkpoint import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def weights(tmp_path_factory):
    """A --cache-dir holding the Orpheus LLM and SNAC checkpoints the model writes itself."""
    from mstar.models.registry import create_model

    d = tmp_path_factory.mktemp("orpheus-weights")
    assert create_model("orpheus", {}, str(d)).write_random_weights(str(d))
    return str(d)
