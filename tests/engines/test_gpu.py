"""GPU-only: FlashInfer backend vs the torch reference, and CUDA-graph decode vs eager.

head_dim 128 and bf16 throughout, so these reuse the JIT kernels the benchmarks build."""

import importlib.util

import pytest
import torch
from engine_helpers import tiny_hf_config
from mstar.services.engines import (
    AttentionBatch,
    EngineConfig,
    HeadShape,
    KVCacheEngine,
    LlamaForCausalLM,
    SamplingParams,
    TorchPagedAttention,
    build_csr,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]

HEADS = HeadShape(8, 2, 128)
PAGE = 16


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1], [5, 70, 300]), ([3, 40, 1], [3, 100, 17])])
def test_flashinfer_matches_torch_reference(causal, q_lens, kv_lens):
    from mstar.services.engines.attn_flashinfer import FlashInferAttention

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    k = torch.randn(64, PAGE, 2, 128, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(64, PAGE, 2, 128, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn(sum(q_lens), 8, 128, generator=gen).to(dev, torch.bfloat16)
    perm = torch.randperm(63, generator=gen).add(1).tolist()
    pages = [[perm.pop() for _ in range(-(-n // PAGE))] for n in kv_lens]
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    batch = AttentionBatch(qo, build_csr(pages, kv_lens, PAGE), torch.zeros(sum(q_lens), dtype=torch.long), causal)
    fi = FlashInferAttention(HEADS, dev, torch.bfloat16, PAGE)
    fi.plan(batch)
    ref = TorchPagedAttention(HEADS, dev)
    ref.plan(batch)
    got, want = fi.run(q, k, v).float(), ref.run(q.float(), k.float(), v.float())
    assert (got - want).abs().max().item() < 2e-2
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_cuda_graph_decode_matches_eager(tmp_path):
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = tiny_hf_config(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    HFLlama(cfg).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    prompts = {f"r{i}": list(range(3 + i, 20 + 5 * i)) for i in range(3)}
    greedy = SamplingParams(temperature=0, max_tokens=12)
    base = dict(page_size=PAGE, kv_cache_bytes=64 * 1024 * 1024, attention="flashinfer")
    graphs = KVCacheEngine(model, EngineConfig(**base, cuda_graphs=True, overlap=True))
    eager = KVCacheEngine(model, EngineConfig(**base, cuda_graphs=False, overlap=False))
    assert graphs.cuda_graphs and graphs.overlap
    a, b = graphs.generate(prompts, greedy), eager.generate(prompts, greedy)
    assert graphs.stats.graph_steps >= 10 and graphs.stats.pipelined_steps >= 5
    same = sum(x == y for k in prompts for x, y in zip(a[k], b[k], strict=True))
    # bf16: a padded batch may round split-kv differently and flip a near-tie token (and the rest of
    # that sequence); broken replay (stale inputs, wrong pages) agrees on almost nothing.
    assert same >= 0.75 * 3 * 12, (a, b)
    assert graphs.cache.num_free_pages == graphs.cache.allocator.num_usable
