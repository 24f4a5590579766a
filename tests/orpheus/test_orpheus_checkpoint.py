import json

import pytest
import torch
from safetensors.torch import save_file

from mstar.models.hub import CheckpointError
from mstar.models.orpheus.checkpoint import load_tensors, open_checkpoint, tensor_shapes, validate_shapes

TENSORS = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.weight": torch.ones(4), "c.bias": torch.zeros(1)}
SHAPES = {k: tuple(v.shape) for k, v in TENSORS.items()}


def write_single(d, tokenizer=True):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file(TENSORS, str(d / "model.safetensors"))
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


def write_sharded(d):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"a.weight": TENSORS["a.weight"]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: TENSORS[k] for k in ("b.weight", "c.bias")}, str(d / "model-00002-of-00002.safetensors"))
    index = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors",
             "c.bias": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (d / "tokenizer.json").write_text("{}")
    return d


def test_single_file_checkpoint(tmp_path):
    files = open_checkpoint(write_single(tmp_path / "m"))
    assert files.config == {"model_type": "llama"}
    assert files.weight_files == (tmp_path / "m" / "model.safetensors",)
    assert tensor_shapes(files) == SHAPES
    validate_shapes(files, SHAPES)
    torch.testing.assert_close(load_tensors(files, ["a.weight"])["a.weight"], TENSORS["a.weight"])


def test_sharded_checkpoint(tmp_path):
    files = open_checkpoint(write_sharded(tmp_path / "m"))
    assert [p.name for p in files.weight_files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert tensor_shapes(files) == SHAPES
    loaded = load_tensors(files)
    assert set(loaded) == set(TENSORS) and all(torch.equal(loaded[k], TENSORS[k]) for k in TENSORS)


def test_missing_shard_and_missing_listed_tensor_are_named(tmp_path):
    d = write_sharded(tmp_path / "m")
    save_file({"b.weight": TENSORS["b.weight"]}, str(d / "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors: missing tensor 'c.bias'"):
        open_checkpoint(d)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lists shard model-00002-of-00002.safetensors but .* is missing"):
        open_checkpoint(d)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing file .*config.json"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="missing weights, neither model.safetensors nor model.safetensors.index.json"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"missing file .*tokenizer.json"):
        open_checkpoint(write_single(tmp_path / "m", tokenizer=False))
    assert open_checkpoint(tmp_path / "m", require_tokenizer=False).tokenizer is None


def test_validate_names_file_and_tensor(tmp_path):
    files = open_checkpoint(write_sharded(tmp_path / "m"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head.weight' \(expected shape \(5, 2\)\)"):
        validate_shapes(files, SHAPES | {"lm_head.weight": (5, 2)})
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002.safetensors: tensor 'a.weight' has shape "
                       r"\(2, 3\), expected \(3, 2\)"):
        validate_shapes(files, SHAPES | {"a.weight": (3, 2)})
    smaller = {k: v for k, v in SHAPES.items() if k != "c.bias"}
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors: unexpected tensor 'c.bias'"):
        validate_shapes(files, smaller)
    validate_shapes(files, smaller, allow_extra=True)


def test_invalid_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: invalid JSON"):
        open_checkpoint(tmp_path)


def test_an_unreadable_weight_file_is_named(tmp_path):
    d = write_single(tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"{}")  # truncated / not safetensors
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        open_checkpoint(d)
