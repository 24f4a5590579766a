"""The encoder and the masked predictor against transformers' VJEPA2Model (fp32, atol 1e-5), from
the Hugging Face safetensors layout and from the same weights in the official .pt layout."""

import pytest
import torch

from mstar.models.vjepa2 import weights
from mstar.models.vjepa2.config import PredictorConfig, VJepa2Config

ATOL = 1e-5


def _load(path):
    enc, pred, ac = weights.build(weights.read(path))
    assert ac is None
    return enc, pred


def _as_pt(hf_dir, out):
    """The same tensors written in the official layout (fused qkv, module.backbone. prefixes)."""
    loaded = weights.read(hf_dir)
    weights.write_pt(out, loaded.config, loaded.encoder, loaded.predictor)
    return out


@pytest.fixture(scope="module", params=["hf", "pt"])
def ours(request, hf_model, tmp_path_factory):
    _, hf_dir = hf_model
    if request.param == "hf":
        return _load(hf_dir)
    return _load(_as_pt(hf_dir, tmp_path_factory.mktemp("pt") / "vitl-tiny.pt"))


def _clip(seed=0, frames=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, frames, 3, 16, 16, generator=g)  # transformers: [B, T, C, H, W]


def test_encoder_matches_transformers(hf_model, ours):
    model, _ = hf_model
    enc, _ = ours
    video = _clip()
    with torch.no_grad():
        want = model(video, skip_predictor=True).last_hidden_state
        got = enc(video.permute(0, 2, 1, 3, 4))
    assert got.shape == (2, 32, 48)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_single_image_is_repeated_into_a_tubelet(hf_model, ours):
    model, _ = hf_model
    enc, _ = ours
    image = _clip(1, frames=1)
    with torch.no_grad():
        torch.testing.assert_close(enc(image.permute(0, 2, 1, 3, 4)), model(image, skip_predictor=True).last_hidden_state,
                                   atol=ATOL, rtol=0)


@pytest.mark.parametrize("split", ["all", "masked"])
def test_masked_predictor_matches_transformers(hf_model, ours, split):
    model, _ = hf_model
    enc, pred = ours
    video = _clip(2)
    n = 32
    if split == "all":  # transformers' default: every token is context and target
        ctx = torch.arange(n).repeat(2, 1)
        tgt = ctx.clone()
    else:  # a shuffled split per sample: sorting by position must put mask tokens in place
        g = torch.Generator().manual_seed(3)
        perms = torch.stack([torch.randperm(n, generator=g) for _ in range(2)])
        ctx, tgt = perms[:, :20], perms[:, 20:]
    with torch.no_grad():
        out = model(video, context_mask=[ctx], target_mask=[tgt])
        want = out.predictor_output.last_hidden_state
        tokens = enc(video.permute(0, 2, 1, 3, 4))
        got = pred(torch.gather(tokens, 1, ctx.unsqueeze(-1).expand(-1, -1, 48)), ctx, tgt)
    assert got.shape == want.shape == (2, tgt.shape[1], 48)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_missing_tensors_are_named(hf_model, tmp_path):
    from safetensors.torch import load_file, save_file

    _, hf_dir = hf_model
    sd = load_file(str(hf_dir / "model.safetensors"))
    del sd["encoder.layer.1.mlp.fc2.bias"]
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(weights.CheckpointError, match=r"encoder: 1 tensors missing.*blocks\.1\.mlp\.fc2\.bias"):
        _load(tmp_path)


def test_prefixed_hf_keys_and_heads_from_the_side_config(hf_model, tmp_path):
    """``vjepa2.``-prefixed keys (the classification checkpoint) load; a .pt's head count comes
    from config.json beside it (widths 48 / 36 have no preset)."""
    from safetensors.torch import load_file, save_file

    _, hf_dir = hf_model
    sd = {f"vjepa2.{k}": v for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file(sd, str(tmp_path / "model.safetensors"))
    loaded = weights.read(tmp_path)
    assert loaded.config.predictor == PredictorConfig(dim=36, depth=2, heads=3, mlp_dim=72, num_mask_tokens=3)
    pt = _as_pt(tmp_path, tmp_path / "pt" / "x.pt")
    (pt.parent / "config.json").unlink()
    with pytest.raises(weights.CheckpointError, match="no preset head count"):
        weights.read(pt)
    assert isinstance(weights.read(tmp_path).config, VJepa2Config)
