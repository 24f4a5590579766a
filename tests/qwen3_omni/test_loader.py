"""The checkpoint reader: the sharded layout, a missing tensor named, random weights made on load."""

import json
import shutil

import pytest
import torch

from mstar.models.hub import CheckpointError
from mstar.models.qwen3_omni.cache import NoCache
from mstar.models.qwen3_omni.direct import load_parts
from mstar.models.qwen3_omni.weights import INDEX_FILE, RANDOM_MARKER


def logits(p, ids):
    with torch.no_grad():
        h, _ = p.thinker(p.thinker.embed(ids), torch.arange(ids.numel()).expand(3, -1), NoCache())
        return p.thinker.logits(h)


def test_sharded_checkpoint_loads_the_same(reference, parts, tmp_path):
    reference.save_pretrained(tmp_path, max_shard_size="300KB")
    assert (tmp_path / INDEX_FILE).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded = load_parts(tmp_path, parts=("thinker", "talker"))
    ids = torch.arange(3, 40)
    assert torch.equal(logits(sharded, ids), logits(parts, ids))
    for a, b in zip(sharded.talker.parameters(), parts.talker.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_missing_tensor_is_named(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "ck"
    shutil.copytree(checkpoint, d)
    tensors = load_file(d / "model.safetensors")
    del tensors["talker.model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"talker\.model\.layers\.1\.mlp\.experts"):
        load_parts(d, parts=("talker",))


def test_random_weights_are_made_on_load_the_same_each_time(checkpoint, tmp_path):
    d = tmp_path / "random"
    d.mkdir()
    shutil.copy(f"{checkpoint}/config.json", d / "config.json")
    (d / RANDOM_MARKER).write_text(json.dumps({"seed": 3, "std": 0.02}))
    a, b = load_parts(d, parts=("thinker",)), load_parts(d, parts=("thinker",))
    ids = torch.arange(3, 20)
    out = logits(a, ids)
    assert torch.isfinite(out).all() and torch.equal(out, logits(b, ids))
    assert a.specials().shape == (3, a.cfg.text.hidden_size)


def test_the_random_checkpoint_is_written_without_transformers_rope_warning():
    """transformers' Talker config warns about mrope_section and interleaved (keys its model reads)
    at every --random-weights start; build_reference drops that one warning."""
    import logging

    from mstar.models.qwen3_omni.tiny import build_reference

    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    rope_log = logging.getLogger("transformers.modeling_rope_utils")
    rope_log.addHandler(handler)
    try:
        build_reference()
    finally:
        rope_log.removeHandler(handler)
    assert not [r.getMessage() for r in seen if "rope_parameters" in r.getMessage()]
