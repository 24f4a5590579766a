"""Tiny checkpoints shared by the V-JEPA 2 tests (session-scoped: each is made once)."""

from pathlib import Path

import pytest
import torch

from mstar.models.vjepa2.config import ACConfig, EncoderConfig, VJepa2Config

DATA = Path(__file__).resolve().parent / "data"

# The masked model against transformers: head_dim 16 in the encoder (three RoPE chunks of 4 and an
# unrotated rest of 4), 12 in the predictor (no rest); 4x4 tokens per tubelet, 2 tubelets.
HF_TINY = dict(hidden_size=48, num_attention_heads=3, num_hidden_layers=2, mlp_ratio=2.0, patch_size=4,
               crop_size=16, frames_per_clip=4, tubelet_size=2, pred_hidden_size=36, pred_num_attention_heads=3,
               pred_num_hidden_layers=2, pred_mlp_ratio=2.0, pred_num_mask_tokens=3)

# The AC model whose reference outputs are in data/ (see data/README.md): 3x3 tokens a frame.
AC_TINY = VJepa2Config(EncoderConfig(dim=32, depth=2, heads=2, mlp_dim=64, patch=4, crop=12, frames=64),
                       None, ACConfig(dim=48, depth=2, heads=3, mlp_dim=192))  # the reference fixes mlp_ratio 4
AC_SEED = 1234


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """(transformers VJEPA2Model in eval mode, its save_pretrained directory). Every parameter is
    random (transformers zero-inits biases and mask tokens: a loader that lost them would pass)."""
    from transformers import VJEPA2Config, VJEPA2Model

    torch.manual_seed(0)
    model = VJEPA2Model(VJEPA2Config(**HF_TINY)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("vjepa2-hf")
    model.save_pretrained(d)
    return model, d


@pytest.fixture(scope="session")
def ac_checkpoint(tmp_path_factory):
    """The tiny AC checkpoint in the official .pt layout (module.backbone. prefixes)."""
    from mstar.models.vjepa2.weights import write_random

    path = tmp_path_factory.mktemp("vjepa2-ac") / "vjepa2-ac-tiny.pt"
    write_random(path, AC_TINY, "pt", seed=AC_SEED)
    return path
