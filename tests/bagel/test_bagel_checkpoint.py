"""Loading the official layout: what is read from where, and errors that name the missing file or
tensor; the tiny --random-weights checkpoint has that layout with distinct experts."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.models.bagel.config import config_from_dir
from mstar.models.bagel.llm import BagelLLM
from mstar.models.bagel.weights import build, ckpt_names
from mstar.models.base import MissingAssets
from mstar.models.hub import CheckpointError
from mstar.models.registry import create_model


def test_layout_and_distinct_experts(ckpt_dir):
    cfg = config_from_dir(ckpt_dir)
    assert json.loads((ckpt_dir / "vit_config.json").read_text())["num_hidden_layers"] == cfg.vit.num_layers + 1
    ema = load_file(str(ckpt_dir / "ema.safetensors"))
    names = ckpt_names(cfg)
    assert set(names["ema.safetensors"]) == set(ema)  # every tensor read, none left over
    assert set(names["ae.safetensors"]) == set(load_file(str(ckpt_dir / "ae.safetensors")))
    gen = [k for k in ema if "_moe_gen" in k]
    assert len(gen) == cfg.llm.num_layers * 14 + 1  # a layer: 2 norms, q/k/v + biases, o, q/k-norm, 3 MLP; + norm_moe_gen
    for k in gen:
        assert not torch.equal(ema[k], ema[k.replace("_moe_gen", "")]), k
    assert ema["vit_model.vision_model.embeddings.patch_embedding.weight"].shape == (32, 588)


def test_missing_file_is_named(ckpt_dir, tmp_path):
    d = tmp_path / "ByteDance-Seed" / "BAGEL-7B-MoT"
    shutil.copytree(ckpt_dir, d)
    (d / "ae.safetensors").unlink()
    with pytest.raises(MissingAssets, match="ae.safetensors"):
        create_model("bagel", {}, str(tmp_path)).check_assets()
    with pytest.raises(MissingAssets, match="--random-weights"):
        create_model("bagel", {}, str(tmp_path / "elsewhere")).check_assets()


def test_missing_or_misshapen_tensor_is_named(ckpt_dir, tmp_path):
    shutil.copytree(ckpt_dir, tmp_path / "c")
    ema = load_file(str(ckpt_dir / "ema.safetensors"))
    gone = "language_model.model.layers.1.self_attn.k_norm_moe_gen.weight"
    save_file({k: v for k, v in ema.items() if k != gone}, str(tmp_path / "c" / "ema.safetensors"))
    cfg = config_from_dir(tmp_path / "c")
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        build(BagelLLM, cfg.llm, tmp_path / "c", "llm", "cpu", torch.float32)
    ema["language_model.lm_head.weight"] = ema["language_model.lm_head.weight"][:, :10].contiguous()
    save_file(ema, str(tmp_path / "c" / "ema.safetensors"))
    with pytest.raises(CheckpointError, match=r"language_model\.lm_head\.weight.*shape"):
        build(BagelLLM, cfg.llm, tmp_path / "c", "llm", "cpu", torch.float32)


def test_placement_kwargs_are_checked():
    with pytest.raises(ValueError, match="did you mean 'cfg_parallel'"):
        create_model("bagel", {"cfg_paralel": True})
    with pytest.raises(ValueError, match="vae_image"):
        create_model("bagel", {"vae_image": [64, 128]})
