"""Helpers for the engine tests: the tiny model's config, an engine factory, and a dense
(non-paged) attention reference built from the same weights."""

from __future__ import annotations

import math

import torch

from mstar.services.engines import EngineConfig, KVCacheEngine, LlamaForCausalLM

PAGE_SIZE = 4


def tiny_hf_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        initializer_range=0.3,  # large enough that logits differ clearly between tokens
        rope_theta=500000.0,
        # original_max_position_embeddings 32 puts head_dim-16 frequencies in all three llama3 bands
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_hf_llama(**overrides):
    """A random transformers Llama on ``tiny_hf_config(**overrides)`` whose RMSNorm weights are
    random too (transformers initialises them to ones, which would hide a norm weight applied
    wrongly, or folded into the wrong projection)."""
    from transformers import LlamaForCausalLM as HFLlama

    model = HFLlama(tiny_hf_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def make_engine(model, num_pages: int = 64, page_size: int = PAGE_SIZE, **kw) -> KVCacheEngine:
    spec = model.config.kv_spec(page_size, torch.float32)
    cfg = EngineConfig(page_size=page_size, kv_cache_bytes=num_pages * spec.bytes_per_page, **kw)
    return KVCacheEngine(model, cfg)


@torch.inference_mode()
def dense_hidden(model: LlamaForCausalLM, embeds: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """Final hidden states of one sequence with plain attention under ``mask`` [T, T]
    (True = may attend): no pages, no CSR, no backend — the yardstick for paged passes."""
    h = embeds
    for layer in model.model.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        n, hs = x.shape[0], a.heads
        q, k, v = a.qkv(x)
        q, k = a.rope(q, k, positions)
        k, v = k.repeat_interleave(hs.group, 1), v.repeat_interleave(hs.group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hs.head_dim)
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1)
        h = h + a.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.model.norm(h)


def causal_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()
