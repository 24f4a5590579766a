"""π0.5's standard pieces against transformers on the same random weights (fp32, atol 1e-5): the SigLIP
vision tower (``SiglipVisionModel``), a Gemma decoder layer (``GemmaDecoderLayer``, bidirectional mask
over valid keys) and the PaliGemma projector."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers' PaliGemma pieces are the reference here")


def test_siglip_vision_matches_transformers(policy):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    v = policy.cfg.vision
    ref = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=v.hidden, intermediate_size=v.mlp, num_hidden_layers=v.layers, num_attention_heads=v.heads,
        image_size=v.image_size, patch_size=v.patch, hidden_act="gelu_pytorch_tanh", layer_norm_eps=v.eps,
        vision_use_head=False)).eval()
    prefix = "vision_model." if any(k.startswith("vision_model.") for k in ref.state_dict()) else ""
    ref.load_state_dict({prefix + k: t for k, t in policy.vision.vision.state_dict().items()})  # strict: same names
    pixels = torch.rand(3, 3, v.image_size, v.image_size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        want = ref(pixel_values=pixels).last_hidden_state
        got = policy.vision.vision(pixels)
    assert want.abs().mean() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_projector_matches_paligemma(policy):
    from transformers import PaliGemmaConfig
    from transformers.models.paligemma.modeling_paligemma import PaliGemmaMultiModalProjector

    c = PaliGemmaConfig()
    c.vision_config.hidden_size, c.vision_config.projection_dim = policy.cfg.vision.hidden, policy.cfg.prefix.width
    ref = PaliGemmaMultiModalProjector(c)
    ref.linear.load_state_dict(policy.vision.projector.state_dict())
    x = torch.randn(2, 16, policy.cfg.vision.hidden)
    with torch.no_grad():
        torch.testing.assert_close(policy.vision.projector(x), ref(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("layer", [0, 1])
def test_gemma_layer_matches_transformers(policy, layer):
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, GemmaRotaryEmbedding

    from mstar.models.pi05.layers import additive_mask, rope_tables

    p = policy.cfg.prefix
    cfg = GemmaConfig(hidden_size=p.width, intermediate_size=p.mlp, num_attention_heads=p.heads,
                      num_key_value_heads=p.kv_heads, head_dim=p.head_dim, rms_norm_eps=p.eps, rope_theta=p.rope_theta,
                      hidden_activation="gelu_pytorch_tanh", num_hidden_layers=1, vocab_size=policy.cfg.vocab)
    cfg._attn_implementation = "eager"
    ours = policy.prefix.layers[layer]
    ref = GemmaDecoderLayer(cfg, 0).eval()
    ref.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(layer)
    x = torch.randn(2, 24, p.width, generator=g)
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[1, 17:] = False
    positions = valid.long().cumsum(1) - 1
    key_mask = additive_mask(valid[:, None, None, :], x.dtype)
    with torch.no_grad():
        want = ref(x, attention_mask=key_mask.expand(2, 1, 24, 24),
                   position_embeddings=GemmaRotaryEmbedding(cfg)(x, positions))
        got, _, _ = ours(x, *rope_tables(positions, policy.prefix.inv_freq, x.dtype), key_mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
