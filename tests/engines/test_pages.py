import pytest
import torch

from mstar.services.engines import KVCacheSpec, OutOfPages, PageAllocator, PagedKVCache, build_csr
from mstar.services.engines.kv_cache import kv_budget_bytes


def test_allocator_alloc_free_and_counts():
    a = PageAllocator(8, num_reserved=1)
    assert a.num_free == 7 and a.num_usable == 7
    got = a.alloc(3)
    assert got == [1, 2, 3] and a.num_free == 4 and a.num_used == 3
    a.free(got[:2])
    assert a.num_free == 6
    rest = a.alloc(6)
    assert 0 not in rest + got  # the reserved page is never handed out
    assert a.num_free == 0


def test_out_of_pages_is_clear():
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(OutOfPages, match=r"wanted 2, 1 free of 4.*kv_cache_bytes") as e:
        a.alloc(2)
    assert (e.value.wanted, e.value.free) == (2, 1)
    assert a.num_free == 1  # a failed alloc takes nothing


def test_double_free_and_reserved_free_raise():
    a = PageAllocator(4, num_reserved=1)
    p = a.alloc(1)
    a.free(p)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(p)
    with pytest.raises(ValueError, match="not allocated"):
        a.free([0])


def test_csr_layout_matches_flashinfer_convention():
    t = build_csr([[5, 2, 9], [7], [3, 4]], kv_lens=[9, 4, 5], page_size=4)
    assert t.kv_indptr.tolist() == [0, 3, 4, 6]
    assert t.kv_indices.tolist() == [5, 2, 9, 7, 3, 4]
    assert t.kv_last_page_len.tolist() == [1, 4, 1]
    assert t.kv_indptr.dtype == t.kv_indices.dtype == t.kv_last_page_len.dtype == torch.int32


def test_csr_uses_only_pages_the_length_needs():
    t = build_csr([[1, 2, 3]], kv_lens=[4], page_size=4)  # capacity beyond the length is left out
    assert t.kv_indices.tolist() == [1] and t.kv_last_page_len.tolist() == [4]
    with pytest.raises(ValueError, match="needs 2 pages, has 1"):
        build_csr([[1]], kv_lens=[5], page_size=4)


def test_bytes_per_token_and_budget():
    spec = KVCacheSpec(num_layers=28, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    assert spec.bytes_per_token == 28 * 2 * 8 * 128 * 2 == 114688
    cache = PagedKVCache.from_budget(
        KVCacheSpec(2, 2, 16, 4, torch.float32), "cpu", kv_cache_bytes=10 * 4 * 2 * 2 * 2 * 16 * 4
    )
    assert cache.allocator.num_pages == 10 and cache.num_free_pages == 9  # page 0 is scratch
    assert tuple(cache.layer(1)[0].shape) == (10, 4, 2, 16)
    with pytest.raises(ValueError, match="kv_cache_bytes is required"):
        kv_budget_bytes(torch.device("cpu"), None, 0.9)


def test_labelled_sequences_reserve_commit_truncate_release():
    cache = PagedKVCache(KVCacheSpec(1, 1, 4, page_size=4, dtype=torch.float32), num_pages=16)
    start = cache.num_free_pages
    for label, n in (("main", 9), ("cfg_text", 4), ("cfg_img", 1)):
        cache.reserve("r", label, n)
        cache.commit("r", label, n)
    assert sorted(cache.labels("r")) == ["cfg_img", "cfg_text", "main"]
    assert start - cache.num_free_pages == 3 + 1 + 1
    assert cache.slots("r", "main", 3, 2) == [
        cache.seq("r", "main").pages[0] * 4 + 3, cache.seq("r", "main").pages[1] * 4
    ]
    cache.reserve("r", "main", 13)  # scratch room for 4 tokens past the committed 9
    cache.truncate("r", "main")
    assert cache.length("r", "main") == 9 and len(cache.seq("r", "main").pages) == 3
    assert cache.release("r") == 5
    assert cache.num_free_pages == start and cache.labels("r") == []


def test_a_graph_table_holds_a_full_cache_and_a_padded_batch():
    """Every usable page in some sequence's table, then a decode batch padded to a graph's size: the
    table has more entries than the cache has pages (each padded row reads scratch page 0), and the
    graphs size their tables by ``table_pages`` (an H100 run once failed its step at batch 400 so)."""
    from mstar.services.engines.batch import SeqSlice, build_step_inputs
    from mstar.services.engines.cuda_graphs import table_pages

    cache = PagedKVCache(KVCacheSpec(1, 1, 4, page_size=4, dtype=torch.float32), num_pages=9)
    seqs = [f"r{i}" for i in range(cache.num_free_pages // 2)]  # two pages each: every usable page
    for rid in seqs:
        cache.reserve(rid, "main", 8)
        cache.commit(rid, "main", 7)
    assert cache.num_free_pages == 0
    inputs = build_step_inputs(cache, [SeqSlice(rid, "main", 7, 1) for rid in seqs], pad_to=8)
    entries = inputs.attn.table.kv_indices.shape[0]
    assert entries == 8 + 4 > cache.allocator.num_pages  # 4 sequences of 2 pages, 4 padded rows
    assert entries <= table_pages(cache.allocator.num_pages, 8)
