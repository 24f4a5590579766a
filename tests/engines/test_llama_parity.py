"""Our Llama on the paged cache vs transformers' LlamaForCausalLM, same random weights, fp32.

Tolerance: atol 1e-4 on logits (they are O(1): initializer_range 0.3)."""

import pytest
import torch
from engine_helpers import causal_mask, dense_hidden, make_engine

from mstar.services.engines import ForwardItem, LlamaConfig, SamplingParams

ATOL = 1e-4
LENGTHS = (5, 9, 2)  # with page size 4: 2, 3 and 1 pages, then decode crosses page boundaries


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


def test_config_reads_llama3_rope(tiny_ckpt):
    cfg = LlamaConfig.from_dir(tiny_ckpt)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.original_max_position_embeddings == 32
    assert cfg.tie_word_embeddings


def test_batched_prefill_and_decode_match_transformers(tiny_model, hf_model):
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]
    eng = make_engine(tiny_model)
    hidden = eng.forward([ForwardItem(f"r{i}", token_ids=torch.tensor(s)) for i, s in enumerate(seqs)])
    worst = 0.0
    for h, s in zip(hidden, seqs, strict=True):
        got, want = eng.logits(h), _hf_logits(hf_model, s)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        worst = max(worst, (got - want).abs().max().item())
    for _step in range(5):  # lengths 5/9/2 -> 10/14/7: every sequence crosses a page boundary
        nxt = [int(eng.logits(h[-1]).argmax()) for h in hidden]
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        hidden = eng.forward([ForwardItem(f"r{i}", token_ids=torch.tensor([t])) for i, t in enumerate(nxt)])
        for i, (h, s) in enumerate(zip(hidden, seqs, strict=True)):
            assert eng.cache.length(f"r{i}") == len(s)
            got, want = eng.logits(h[-1]), _hf_logits(hf_model, s)[-1]
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
            worst = max(worst, (got - want).abs().max().item())
    assert worst < ATOL


def test_dense_reference_matches_transformers(tiny_model, hf_model):
    """Ties the reference used by the loop-shape tests to transformers."""
    ids = torch.arange(3, 14)
    h = dense_hidden(tiny_model, tiny_model.embed(ids), torch.arange(11), causal_mask(11))
    torch.testing.assert_close(tiny_model.compute_logits(h), _hf_logits(hf_model, ids.tolist()), atol=ATOL, rtol=0)


@pytest.mark.parametrize("budget", [2048, 3])  # 3: prompts are prefilled in chunks of <= 3 tokens
def test_scheduled_greedy_generation_matches_transformers(tiny_model, hf_model, budget):
    prompts = {"a": [7, 8, 9, 10, 11], "b": list(range(30, 39)), "c": [200, 3]}
    eng = make_engine(tiny_model, max_num_batched_tokens=budget)
    start = eng.cache.num_free_pages
    eos = hf_model.generation_config.eos_token_id  # both stop there, so outputs stay comparable
    out = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(eos,)))
    for rid, ids in prompts.items():
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
        assert out[rid] == want.tolist(), rid
    assert eng.cache.num_free_pages == start


def test_column_major_weights_give_the_same_logits(tiny_model):
    """The CUDA load-time layout (projection weights stored transposed) changes no value."""
    import copy

    from mstar.services.engines.layers import set_weight_layout

    ids = torch.arange(3, 14)
    want = tiny_model.compute_logits(dense_hidden(tiny_model, tiny_model.embed(ids), torch.arange(11), causal_mask(11)))
    model = copy.deepcopy(tiny_model)
    set_weight_layout(model, column_major=True)
    w = model.model.layers[1].self_attn.qkv_proj.weight
    assert w.stride() == (1, w.shape[0]) and torch.equal(w, tiny_model.model.layers[1].self_attn.qkv_proj.weight)
    got = model.compute_logits(dense_hidden(model, model.embed(ids), torch.arange(11), causal_mask(11)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    set_weight_layout(model, column_major=False, only="down_proj")  # as the Triton down projection needs
    layer = model.model.layers[1]
    assert layer.mlp.down_proj.weight.is_contiguous() and not layer.mlp.gate_up_proj.weight.is_contiguous()
    assert torch.equal(layer.mlp.down_proj.weight, tiny_model.model.layers[1].mlp.down_proj.weight)
    set_weight_layout(model, column_major=False)
    assert all(p.is_contiguous() for p in model.parameters())
