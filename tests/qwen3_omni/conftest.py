"""Shared fixtures: the tiny random Qwen3-Omni written with transformers' classes in the real
layout (one per session), the reference model with the same weights, and its parts loaded by our
loader. Tiny models run faster on one thread than on a CPU shared with other work."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A --cache-dir holding the checkpoint the model writes itself (tiny, random, real layout)."""
    from mstar.models.registry import create_model

    d = tmp_path_factory.mktemp("omni-weights")
    assert create_model("qwen3_omni", {}, str(d)).write_random_weights(str(d))
    return str(d)


@pytest.fixture(scope="session")
def checkpoint(cache_dir):
    from mstar.models.qwen3_omni.knobs import DEFAULT_CHECKPOINT

    return f"{cache_dir}/{DEFAULT_CHECKPOINT}"


@pytest.fixture(scope="session")
def reference(checkpoint):
    """transformers' Qwen3OmniMoeForConditionalGeneration loaded from the same checkpoint (by
    transformers' own loader), fp32, eval."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def parts(checkpoint):
    from mstar.models.qwen3_omni.direct import load_parts

    return load_parts(checkpoint)


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{checkpoint}/tokenizer.json")
