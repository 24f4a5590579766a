"""BAGEL's pieces against independent implementations where they match, in fp32 on CPU:
the FLUX VAE against diffusers' AutoencoderKL with the FLUX configuration (our tiny widths),
loaded from the same ae.safetensors through diffusers' own FLUX/LDM name conversion; the SigLIP
encoder against transformers' SiglipVisionModel (conv stem vs our 588-input Linear); the
understanding expert against transformers' Qwen3 (Qwen2 + QK-norm; its o_proj bias zeroed, as
Qwen2 has none). Non-square inputs throughout."""

import pytest
import torch
from bagel_checks import rel_err
from safetensors.torch import load_file

from mstar.models.bagel.config import BagelConfig, SpecialTokens, ViTConfig, config_from_dir
from mstar.services.engines.kv_engine import ForwardItem

TOL = 1e-4


def test_vae_matches_diffusers(ckpt_dir, pipeline):
    diffusers = pytest.importorskip("diffusers", reason="diffusers is the VAE's reference (pip install diffusers)")
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    vcfg = config_from_dir(ckpt_dir).vae
    widths = tuple(vcfg.ch * m for m in vcfg.ch_mult)
    ref = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(widths),
        up_block_types=("UpDecoderBlock2D",) * len(widths), block_out_channels=widths, layers_per_block=vcfg.num_res_blocks,
        latent_channels=16, norm_num_groups=32, act_fn="silu", use_quant_conv=False, use_post_quant_conv=False,
        scaling_factor=0.3611, shift_factor=0.1159).eval()
    state = convert_ldm_vae_checkpoint(load_file(str(ckpt_dir / "ae.safetensors")), ref.config)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    x = torch.rand(1, 3, 48, 80, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.inference_mode():
        ours = pipeline.vae.encode(x)  # the posterior mean, scaled and shifted
        theirs = (ref.encode(x).latent_dist.mean - 0.1159) * 0.3611
        assert ours.shape == (1, 16, 6, 10)
        assert rel_err(ours, theirs) < TOL
        z = torch.randn(1, 16, 4, 7, generator=torch.Generator().manual_seed(1))
        assert rel_err(pipeline.vae.decode(z), ref.decode(z / 0.3611 + 0.1159).sample) < TOL


def test_siglip_encoder_matches_transformers():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from mstar.models.bagel.vit import VisionEncoder, patch_position_ids, patchify
    from mstar.models.bagel.weights import vit_name

    hf_cfg = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=56, patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = SiglipVisionModel(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    # a 4x4-patch table, so that HF's position arange(16) is our row * 4 + col
    cfg = BagelConfig(config_from_llm(), ViTConfig(32, 64, 2, 2, 14, 56), None, SpecialTokens(0, 0, 0, 0),
                      vit_max_patches_per_side=4)
    ours = VisionEncoder(cfg).eval()
    hf_state = hf.state_dict()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.startswith("connector_"):
                continue
            src = hf_state[vit_name(name).replace("vit_model.vision_model.", "")]
            p.copy_(src.permute(0, 2, 3, 1).reshape(32, -1) if name == "patch_embedding.weight" else src)
    img = torch.rand(1, 3, 56, 56) * 2 - 1
    with torch.inference_mode():
        want = hf(pixel_values=img).last_hidden_state[0]
        got = ours.encode(patchify(img[0], 14), patch_position_ids(56, 56, 14, 4), [16])
    assert rel_err(got, want) < TOL


def config_from_llm():
    from mstar.models.bagel.config import LLMConfig

    return LLMConfig(100, 64, 128, 2, 4, 2)


def test_understanding_expert_matches_transformers_qwen3(pipeline):
    """Text through the understanding expert (causal, consecutive positions) = Qwen3 with biases."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    lm = pipeline.lm
    c = lm.cfg.llm
    hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                                      rope_theta=c.rope_theta, attention_bias=True, tie_word_embeddings=False)).eval()
    ours = lm.llm
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours.embed_tokens.weight)
        hf.model.norm.weight.copy_(ours.norm.weight)
        hf.lm_head.weight.copy_(ours.lm_head.weight)
        for mine, theirs in zip(ours.layers, hf.model.layers, strict=True):
            e, a = mine.und, theirs.self_attn
            for n in ("q_proj", "k_proj", "v_proj"):
                getattr(a, n).load_state_dict(getattr(e, n).state_dict())
            a.o_proj.weight.copy_(e.o_proj.weight)
            a.o_proj.bias.zero_()
            a.q_norm.weight.copy_(e.q_norm.weight)
            a.k_norm.weight.copy_(e.k_norm.weight)
            theirs.input_layernorm.weight.copy_(e.input_norm.weight)
            theirs.post_attention_layernorm.weight.copy_(e.post_norm.weight)
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(theirs.mlp, n).weight.copy_(getattr(e, n).weight)
    ids = torch.randint(0, c.vocab_size, (23,), generator=torch.Generator().manual_seed(3))
    try:
        (hidden,) = lm._pass([ForwardItem("qwen", "main", token_ids=ids)], None, causal=True)
        with torch.inference_mode():
            want = hf(ids[None]).logits[0]
        assert rel_err(ours.compute_logits(hidden), want) < TOL
    finally:
        lm.release("qwen")


@pytest.mark.parametrize("cfg_img, interval", [(1.0, (0.4, 1.0)), (2.0, (0.0, 1.0)), (2.0, (0.4, 1.0))])
def test_combine_sends_x_only_to_the_branches_a_step_uses(cfg_img, interval):
    """image_gen_cfg: at each step the combine node gives the text branch x only when that step's
    CFG uses it (inside the interval), the image branch only with cfg_img > 1 as well: the others
    get an empty tensor, so nothing crosses to their group. The main branch gets x at every step."""
    from mstar.models.bagel.flow import FlowParams
    from mstar.models.bagel.nodes import CFG_IMG, CFG_TEXT, CombineNode, flow_of, needed
    from mstar.models.base import NodeCall

    p = FlowParams(32, 32, num_timesteps=8, cfg_img=cfg_img, interval=interval)
    node = CombineNode.__new__(CombineNode)
    node.device = "cpu"
    x = torch.randn(1, 4, 16)
    _, ts, _ = flow_of(NodeCall("r", "image_gen_cfg", 0, {"gen": p.as_tensor()}, {}, {}))
    sent = {"x_text": 0, "x_img": 0}
    for i in range(len(ts) + 1):
        v = {k: torch.zeros_like(x) for k in ("v_cond", "v_text", "v_img")} if i else {}
        out = node.forward([NodeCall("r", "image_gen_cfg", i, {"x": x, "gen": p.as_tensor(), **v}, {}, {})])[0]
        uses = needed(p, ts[i]) if i < len(ts) else ()
        assert out["x"].numel() == (x.numel() if i < len(ts) else 0)
        for name, label in (("x_text", CFG_TEXT), ("x_img", CFG_IMG)):
            assert out[name].numel() == (x.numel() if label in uses else 0), (i, name)
            sent[name] += out[name].numel() > 0
    in_interval = sum(interval[0] < t <= interval[1] for t in ts)
    assert sent["x_text"] == in_interval and sent["x_img"] == (in_interval if cfg_img > 1 else 0)
    assert 0 < in_interval <= len(ts)
