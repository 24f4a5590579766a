"""The torch paged backend against dense attention on scattered pages (GQA, prefix + new tokens)."""

import math

import pytest
import torch

from mstar.services.engines import AttentionBatch, HeadShape, TorchPagedAttention, build_csr

HEADS = HeadShape(num_qo_heads=6, num_kv_heads=2, head_dim=8)
PAGE = 4


def _dense(q, k, v, causal):
    """q [n, Hq, D], k/v [kv, Hkv, D] of one sequence; queries are the last n positions."""
    n, kv = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(HEADS.group, 1), v.repeat_interleave(HEADS.group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEADS.head_dim)
    if causal:
        pos = kv - n + torch.arange(n)
        s = s.masked_fill(torch.arange(kv)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def _scatter(seq_kv, num_pages, gen):
    """Place each sequence's K/V on shuffled pages; returns caches and page lists."""
    k_cache = torch.randn(num_pages, PAGE, HEADS.num_kv_heads, HEADS.head_dim, generator=gen)  # junk elsewhere
    v_cache = torch.randn_like(k_cache)
    free = torch.randperm(num_pages - 1, generator=gen).add(1).tolist()
    page_lists = []
    for k, v in seq_kv:
        pages = [free.pop() for _ in range(-(-k.shape[0] // PAGE))]
        for t in range(k.shape[0]):
            k_cache[pages[t // PAGE], t % PAGE] = k[t]
            v_cache[pages[t // PAGE], t % PAGE] = v[t]
        page_lists.append(pages)
    return k_cache, v_cache, page_lists


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_lens,kv_lens", [((1, 1, 1), (1, 6, 13)), ((3, 5, 1), (3, 11, 9))])
def test_torch_paged_matches_dense(causal, q_lens, kv_lens):
    gen = torch.Generator().manual_seed(1)
    seq_kv = [(torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen)) for n in kv_lens]
    qs = [torch.randn(n, 6, 8, generator=gen) for n in q_lens]
    k_cache, v_cache, page_lists = _scatter(seq_kv, 32, gen)
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    batch = AttentionBatch(qo, build_csr(page_lists, kv_lens, PAGE), torch.zeros(sum(q_lens), dtype=torch.long), causal)
    backend = TorchPagedAttention(HEADS)
    backend.plan(batch)
    out = backend.run(torch.cat(qs), k_cache, v_cache)
    want = torch.cat([_dense(q, k, v, causal) for q, (k, v) in zip(qs, seq_kv, strict=True)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_run_before_plan_raises():
    with pytest.raises(RuntimeError, match="before plan"):
        TorchPagedAttention(HEADS).run(torch.zeros(1, 6, 8), torch.zeros(2, PAGE, 2, 8), torch.zeros(2, PAGE, 2, 8))
