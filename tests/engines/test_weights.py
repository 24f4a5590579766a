import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.services.engines import LlamaForCausalLM, WeightLoadError
from mstar.services.engines.weights import Target, checkpoint_targets, load_state_dict


def _copy_with(tiny_ckpt, tmp_path, edit):
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(tiny_ckpt / "config.json", d)
    tensors = load_file(tiny_ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors")
    return d


def test_sharded_checkpoint_loads_the_same_weights(tiny_ckpt, tiny_model, tmp_path):
    from transformers import LlamaForCausalLM as HFLlama

    d = tmp_path / "sharded"
    HFLlama.from_pretrained(tiny_ckpt, dtype=torch.float32).save_pretrained(d, max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
    for (name, a), b in zip(tiny_model.state_dict().items(), sharded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert sharded.lm_head.weight is sharded.model.embed_tokens.weight  # tie_word_embeddings


def test_missing_tensor_names_it(tiny_ckpt, tmp_path):
    d = _copy_with(tiny_ckpt, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' missing.*model\.safetensors"):
        LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)


def test_mismatched_tensor_names_file_and_tensor(tiny_ckpt, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    d = _copy_with(tiny_ckpt, tmp_path, edit)
    with pytest.raises(WeightLoadError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' "
                                              r"has shape \(16, 64\), the model expects \(32, 64\)"):
        LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)


def test_unexpected_tensor_names_it(tiny_ckpt, tmp_path):
    def edit(t):
        t["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # old HF extra: ignored

    d = _copy_with(tiny_ckpt, tmp_path, edit)
    with pytest.raises(WeightLoadError, match=r"tensor 'model\.layers\.9\.mlp\.up_proj\.weight' has no parameter"):
        LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)


def test_index_pointing_at_missing_shard(tiny_ckpt, tmp_path):
    d = _copy_with(tiny_ckpt, tmp_path, lambda t: None)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}))
    with pytest.raises(WeightLoadError, match="'lm_head.weight' maps to missing file 'gone.safetensors'"):
        LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)


def test_fused_projections_stack_the_checkpoint_tensors(tiny_ckpt, tiny_model):
    t = load_file(tiny_ckpt / "model.safetensors")
    attn, mlp = tiny_model.model.layers[1].self_attn, tiny_model.model.layers[1].mlp
    p = "model.layers.1"
    want_qkv = torch.cat([t[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"])
    want_gate_up = torch.cat([t[f"{p}.mlp.gate_proj.weight"], t[f"{p}.mlp.up_proj.weight"]])
    assert torch.equal(attn.qkv_proj.weight, want_qkv) and torch.equal(mlp.gate_up_proj.weight, want_gate_up)
    targets = checkpoint_targets(tiny_model)
    assert targets[f"{p}.self_attn.k_proj.weight"] == Target(f"{p}.self_attn.qkv_proj.weight", 64, 32)
    assert targets[f"{p}.mlp.up_proj.weight"] == Target(f"{p}.mlp.gate_up_proj.weight", 128, 128)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in targets)  # never a checkpoint name


def test_load_state_dict_from_memory_matches_the_checkpoint_and_checks_names(tiny_ckpt, tiny_model):
    tensors = load_file(tiny_ckpt / "model.safetensors")
    with torch.device("meta"):
        fresh = LlamaForCausalLM(tiny_model.config)
    fresh = fresh.to_empty(device="cpu")
    fresh.lm_head.weight = fresh.model.embed_tokens.weight
    load_state_dict(fresh, tensors)
    for (name, a), b in zip(tiny_model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"'model\.layers\.0\.self_attn\.v_proj\.weight' missing"):
        load_state_dict(fresh, tensors)
