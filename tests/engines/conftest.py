"""Session fixtures: a tiny random Hugging Face Llama checkpoint and our model loaded from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import tiny_hf_llama

from mstar.services.engines import LlamaForCausalLM


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny_llama")
    tiny_hf_llama().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def hf_model(tiny_ckpt):
    from transformers import LlamaForCausalLM as HFLlama

    return HFLlama.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)

