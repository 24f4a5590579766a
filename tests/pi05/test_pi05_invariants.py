"""What must hold whatever the weights: masked cameras and padding leave the valid rows alone, a batch
equals its requests run alone, the prompt and the state bins follow the formula, checkpoints load
under every spelling of their names (and say which file or tensor is missing), statistics load from
lerobot's and openpi's layouts; fused projections keep the checkpoint names."""

import json

import numpy as np
import pytest
import torch

from mstar.models.pi05.policy import pixels_from_uint8
from mstar.models.pi05.prompt import PromptTokenizer, discretize, pad_tokens, prompt_text
from mstar.models.pi05.stats import load_norm_stats
from mstar.models.pi05.weights import WeightsError, load_policy, random_tensors, write_checkpoint


def make_inputs(cfg, b, seed=0, lengths=(20, 33)):
    g = torch.Generator().manual_seed(seed)
    s, n = cfg.vision.image_size, cfg.max_token_len
    pixels = pixels_from_uint8(torch.randint(0, 256, (b, 3, 3, s, s), generator=g, dtype=torch.uint8), torch.float32)
    image_mask = torch.ones(b, 3, dtype=torch.bool)
    token_mask = torch.arange(n)[None, :] < torch.tensor(lengths[:b])[:, None]
    tokens = torch.randint(4, cfg.vocab, (b, n), generator=g) * token_mask
    noise = torch.randn(b, cfg.action_horizon, cfg.action_dim, generator=g)
    return pixels, image_mask, tokens, token_mask, noise


def test_masked_camera_and_padding_leave_valid_rows_unchanged(policy):
    pixels, image_mask, tokens, token_mask, noise = make_inputs(policy.cfg, 1)
    image_mask[0, 1] = False
    other_pixels, other_tokens = pixels.clone(), tokens.clone()
    other_pixels[0, 1] = -pixels[0, 1]  # what the masked camera holds
    other_tokens[0, 20:] = torch.arange(5, 5 + tokens.shape[1] - 20)  # what the padding holds
    with torch.no_grad():
        kv, valid = policy.prefix(policy.embed_images(pixels, image_mask), image_mask, tokens, token_mask)
        kv2, valid2 = policy.prefix(policy.embed_images(other_pixels, image_mask), image_mask, other_tokens, token_mask)
    assert torch.equal(valid, valid2) and int(valid.sum()) == 2 * 16 + 20
    torch.testing.assert_close(kv[:, :, :, :, valid[0]], kv2[:, :, :, :, valid[0]], atol=0, rtol=0)
    a = policy.sample_actions(pixels, image_mask, tokens, token_mask, noise)
    b = policy.sample_actions(other_pixels, image_mask, other_tokens, token_mask, noise)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # and the masked camera does change the actions when it is present
    image_mask[0, 1] = True
    assert not torch.allclose(policy.sample_actions(pixels, image_mask, tokens, token_mask, noise), a, atol=1e-3)


def test_batch_of_two_equals_two_batches_of_one(policy):
    pixels, image_mask, tokens, token_mask, noise = make_inputs(policy.cfg, 2, seed=1)
    image_mask[1, 0] = False
    both = policy.sample_actions(pixels, image_mask, tokens, token_mask, noise)
    for i in range(2):
        one = policy.sample_actions(*(t[i:i + 1] for t in (pixels, image_mask, tokens, token_mask, noise)))
        torch.testing.assert_close(both[i:i + 1], one, atol=1e-5, rtol=0)
    assert not torch.allclose(both[0], both[1], atol=1e-2)


def test_state_bins_and_prompt_follow_the_formula():
    x = np.array([-1.0, -0.99, 0.0, 0.5, 0.999, 1.0, -1.5, 1.5])
    bins = discretize(x)
    assert bins.tolist() == [0, 1, 128, 192, 255, 255, -1, 255]
    # np.digitize(x, linspace(-1, 1, 257)[:-1]) - 1 is floor((x + 1) * 128) inside [-1, 1)
    rng = np.random.default_rng(0)
    y = rng.uniform(-1, 1, 1000)
    assert (discretize(y) == np.floor((y + 1) * 128).astype(int)).all()
    assert (prompt_text("  pick_up the\ncube ", bins)
            == "Task: pick up the cube, State: 0 1 128 192 255 255 -1 255;\nAction: ")


def test_request_prompt_normalises_the_state_with_the_checkpoints_quantiles(pi05_cache, ckpt_dir):
    from mstar.models.base import InputFile, Prompt
    from mstar.models.registry import create_model

    model = create_model("pi05", {}, pi05_cache)
    model.prepare_conductor()
    q = load_norm_stats(ckpt_dir).state.stats
    state = (q["q01"] + (q["q99"] - q["q01"]) * np.linspace(0.05, 0.95, 8)).tolist()
    img = png(np.zeros((56, 56, 3), np.uint8))
    st = model.process_prompt(Prompt("stack the cups", [InputFile("base_0_rgb", "image/png", img)],
                                     model.validate_kwargs({"state": state})))
    bins = np.floor((2 * np.linspace(0.05, 0.95, 8)) * 128).astype(int)  # 2 (x - q01) / (q99 - q01) - 1, binned
    text = f"Task: stack the cups, State: {' '.join(map(str, bins))};\nAction: "
    tokens, mask = pad_tokens(PromptTokenizer(ckpt_dir).encode(text), 48)
    assert torch.equal(st.data["prefill"]["tokens"], tokens) and torch.equal(st.data["prefill"]["token_mask"], mask)
    assert st.data["prefill"]["image_mask"].tolist() == [True, False, False]


def test_tokenizers_bos_padding_and_truncation(ckpt_dir, tmp_path):
    tok = PromptTokenizer(ckpt_dir)
    ids = tok.encode("Task: go, State: 1 2;\nAction: ")
    assert ids[0] == 2 and ids.count(2) == 1 and len(ids) > 20
    tokens, mask = pad_tokens(ids, 48)
    assert tokens[: len(ids)].tolist() == ids and mask.sum() == len(ids) and tokens[len(ids):].eq(0).all()
    tokens, mask = pad_tokens(ids, 10)
    assert tokens.tolist() == ids[:10] and mask.all()
    sentencepiece = pytest.importorskip("sentencepiece", reason="the PaliGemma tokenizer model is read with sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"Task: pick up the cube number {i}, State: {i} {2 * i} {i + 7};" for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=64,
                                             model_type="bpe", bos_id=2, eos_id=1, pad_id=0, unk_id=3,
                                             minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    text = "Task: pick up the cube, State: 3 14;\nAction: "
    assert PromptTokenizer(tmp_path).encode(text) == sp.encode(text, add_bos=True)


def test_checkpoint_name_spellings_load_the_same_weights(policy, tmp_path):
    from safetensors.torch import save_file

    tensors = random_tensors(policy.cfg, seed=0)
    tower = "paligemma_with_expert.paligemma.model.vision_tower.vision_model."
    renamed = {"model." + (k.replace(tower, "paligemma_with_expert.paligemma.vision_tower.")
                           .replace(".model.language_model.", ".language_model.model.")): v for k, v in tensors.items()}
    write_checkpoint(tmp_path, policy.cfg)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    other = load_policy(tmp_path)
    for a, b in ((policy.vision, other.vision), (policy.prefix, other.prefix), (policy.expert, other.expert)):
        for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert torch.equal(x, y), n


def test_missing_tensor_or_file_is_named(policy, tmp_path):
    from safetensors.torch import save_file

    tensors = random_tensors(policy.cfg, seed=0)
    gone = "paligemma_with_expert.gemma_expert.model.layers.1.post_attention_layernorm.dense.bias"
    del tensors[gone]
    write_checkpoint(tmp_path, policy.cfg)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=f"model.safetensors: missing tensor '{gone}'"):
        load_policy(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="missing file .*model.safetensors"):
        load_policy(tmp_path)


def test_openpi_norm_stats_json(tmp_path):
    stats = {"norm_stats": {"state": {"mean": [0, 0], "std": [1, 1], "q01": [-2.0, 0.0], "q99": [2.0, 1.0]},
                            "actions": {"mean": [0], "std": [1], "q01": [1.0], "q99": [3.0]}}}
    (tmp_path / "assets" / "droid").mkdir(parents=True)
    (tmp_path / "assets" / "droid" / "norm_stats.json").write_text(json.dumps(stats))
    ns = load_norm_stats(tmp_path)
    np.testing.assert_allclose(ns.state.normalize(np.array([0.0, 1.0])), [2.0 / (4.0 + 1e-6) * 2 - 1, 1.0 / (1.0 + 1e-6) * 2 - 1])
    np.testing.assert_allclose(ns.action.unnormalize(np.array([-1.0, 1.0])), [1.0, 3.0 + 1e-6])
    assert load_norm_stats(tmp_path / "assets") is None


def png(array: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def too_many_pixels() -> bytes:
    """A small JPEG whose header declares one row more than MAX_IMAGE_PIXELS allows."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (4096, 4097)).save(buf, format="JPEG", quality=10)
    return buf.getvalue()


def test_an_image_with_too_many_pixels_is_refused_before_it_is_decoded(monkeypatch):
    from PIL import Image, ImageFile

    from mstar.models.pi05.images import MAX_IMAGE_PIXELS, decode_image

    data = too_many_pixels()
    assert len(data) < 200_000 and MAX_IMAGE_PIXELS == 4096 * 4096
    def no_decode(*a, **k):
        pytest.fail("decoded before the size was checked")
    for target in (Image.Image, ImageFile.ImageFile):  # Pillow decodes in load(); convert() would load
        monkeypatch.setattr(target, "load", no_decode)
    with pytest.raises(ValueError, match=r"an image of 4096x4097 pixels; at most 16777216 pixels"):
        decode_image(data, 224)
    monkeypatch.undo()
    assert decode_image(png(np.full((40, 60, 3), 7, np.uint8)), 224).shape == (3, 224, 224)


def test_fused_projections_keep_one_copy_and_the_checkpoint_names():
    """fuse(): one weight for q / k / v (and gate / up), the Linears' parameters views of it: state_dict
    keys and values unchanged, a later load_state_dict reaches the fused weight, the concatenated
    output equals the separate Linears'; an unfused block says what to do."""
    from mstar.models.pi05.config import tiny_config
    from mstar.models.pi05.layers import GemmaAttention, GemmaMLP, SiglipAttention

    cfg = tiny_config()
    torch.manual_seed(0)
    for block, names, x in ((GemmaAttention(cfg.prefix), ("q_proj", "k_proj", "v_proj"), torch.randn(2, 5, cfg.prefix.width)),
                            (GemmaMLP(cfg.prefix), ("gate_proj", "up_proj"), torch.randn(2, 5, cfg.prefix.width)),
                            (SiglipAttention(cfg.vision), ("q_proj", "k_proj", "v_proj"), torch.randn(2, 5, cfg.vision.hidden))):
        with pytest.raises(RuntimeError, match="call fuse"):
            block.fused(x)
        before = {k: v.clone() for k, v in block.state_dict().items()}
        want = torch.cat([getattr(block, n)(x) for n in names], dim=-1)
        block.fuse()
        after = block.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        assert all(getattr(block, n).weight.untyped_storage().data_ptr() == block.fused_weight()[0].untyped_storage().data_ptr()
                   for n in names)
        torch.testing.assert_close(block.fused(x), want, atol=1e-6, rtol=0)
        block.load_state_dict({k: v + 1 for k, v in before.items()})
        torch.testing.assert_close(block.fused_weight()[0], torch.cat([before[f"{n}.weight"] + 1 for n in names]))
