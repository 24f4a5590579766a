"""Tensor parallelism: each rank loads its shard of a Hugging Face checkpoint, and a TP=2
engine (two CPU processes over gloo) produces the logits and tokens of the TP=1 engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from engine_helpers import PAGE_SIZE, tiny_hf_config

from mstar.services.engines import EngineConfig, KVCacheEngine, LlamaForCausalLM
from mstar.services.engines.direct import ForwardItem
from mstar.services.engines.sampling import SamplingParams
from mstar.services.engines.weights import WeightLoadError

from helpers import run_ranks

PROMPTS = {"a": [1, 5, 9, 17, 33, 2, 7], "b": [3, 3, 100, 42]}
JOIN_TIMEOUT_S = 120
TOL = 1e-4  # fp32: the all-reduce sums the two halves of each row-parallel GEMM in another order


@dataclass(frozen=True)
class RankOnly:
    """A rank for loading weights: no process group (forward passes would need one)."""

    rank: int
    size: int

    def all_reduce(self, x):
        raise AssertionError("no collectives when only loading")


@pytest.fixture(scope="module")
def biased_ckpt(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(1)
    d = tmp_path_factory.mktemp("tiny_llama_biased")
    HFLlama(tiny_hf_config(attention_bias=True, mlp_bias=True)).eval().save_pretrained(d)
    return d


def test_each_rank_loads_its_shard(biased_ckpt):
    from safetensors.torch import load_file

    ref = load_file(str(biased_ckpt / "model.safetensors"))
    for rank in (0, 1):
        m = LlamaForCausalLM.from_pretrained(biased_ckpt, dtype=torch.float32, tp=RankOnly(rank, 2))
        assert (m.config.num_heads, m.config.num_kv_heads, m.config.intermediate_size) == (2, 1, 64)
        att, mlp = m.model.layers[1].self_attn, m.model.layers[1].mlp
        p = "model.layers.1."
        q, k, v = (ref[f"{p}self_attn.{n}_proj.weight"].chunk(2, 0)[rank] for n in "qkv")
        assert torch.equal(att.qkv_proj.weight, torch.cat([q, k, v]))
        qb, kb, vb = (ref[f"{p}self_attn.{n}_proj.bias"].chunk(2, 0)[rank] for n in "qkv")
        assert torch.equal(att.qkv_proj.bias, torch.cat([qb, kb, vb]))
        assert torch.equal(att.o_proj.weight, ref[f"{p}self_attn.o_proj.weight"].chunk(2, 1)[rank])
        gate, up = (ref[f"{p}mlp.{n}_proj.weight"].chunk(2, 0)[rank] for n in ("gate", "up"))
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))
        assert torch.equal(mlp.down_proj.weight, ref[f"{p}mlp.down_proj.weight"].chunk(2, 1)[rank])
        # row-parallel biases are added once, by rank 0
        for lin, name in ((att.o_proj, "self_attn.o_proj.bias"), (mlp.down_proj, "mlp.down_proj.bias")):
            assert torch.equal(lin.bias, ref[p + name] if rank == 0 else torch.zeros_like(lin.bias))
        assert torch.equal(m.model.embed_tokens.weight, ref["model.embed_tokens.weight"])  # replicated


def test_heads_that_do_not_split_are_refused(biased_ckpt):
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not split over tp_size=4"):
        LlamaForCausalLM.from_pretrained(biased_ckpt, dtype=torch.float32, tp=RankOnly(0, 4))


def test_a_shard_of_the_wrong_shape_names_the_tensor(tmp_path, biased_ckpt):
    from safetensors.torch import load_file, save_file

    t = load_file(str(biased_ckpt / "model.safetensors"))
    t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :96].contiguous()
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((biased_ckpt / "config.json").read_text())
    with pytest.raises(WeightLoadError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \(64, 96\).*"
                       r"each of 2 tensor-parallel ranks \(split along dim 1\)"):
        LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, tp=RankOnly(0, 2))


def _engine(model, tp=None) -> KVCacheEngine:
    spec = model.config.kv_spec(PAGE_SIZE, torch.float32)
    return KVCacheEngine(model, EngineConfig(page_size=PAGE_SIZE, kv_cache_bytes=64 * spec.bytes_per_page), tp=tp)


def _run(engine: KVCacheEngine) -> dict:
    """Greedy tokens of the scheduled path, then a direct prefill pass's logits."""
    tokens = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    hidden = engine.forward([ForwardItem("direct", token_ids=torch.tensor(PROMPTS["a"]))])[0]
    return {"tokens": tokens, "logits": engine.logits(hidden)}


def _rank_main(rank: int, ckpt: str, init: str, out: str) -> None:
    from mstar.services.engines.tensor_parallel import TensorParallel, TPSpec

    torch.set_num_threads(1)
    tp = TensorParallel(TPSpec(rank, 2, init), "cpu")
    engine = _engine(LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, tp=tp), tp)
    if rank == 0:
        torch.save(_run(engine), out)
        engine.close()
    else:
        engine.follow()
    # Both ranks done before either tears the group down: a rank destroying it while the other's
    # last receive is in flight aborts that one (gloo: "terminate called without an active exception").
    torch.distributed.barrier()
    tp.close()


@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "biased_ckpt"])
def test_tp2_engine_matches_tp1(ckpt_name, request, tmp_path):
    ckpt = request.getfixturevalue(ckpt_name)
    out = tmp_path / "rank0.pt"
    run_ranks(_rank_main, (str(ckpt), f"file://{tmp_path}/store", str(out)), JOIN_TIMEOUT_S)
    got = torch.load(out)
    want = _run(_engine(LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)))
    assert got["tokens"] == want["tokens"]
    torch.testing.assert_close(got["logits"], want["logits"], atol=TOL, rtol=TOL)
