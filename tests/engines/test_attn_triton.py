"""The fused Triton decode kernel (RoPE + K/V store + paged GQA attention) against the torch
reference: on a CPU through Triton's interpreter in fp32 (atol 1e-4), on a GPU in bf16 (in
test_gpu.py's style: relative error 1e-2)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels in numpy
pytest.importorskip("triton", reason="the Triton decode kernel needs the triton package (pip install triton)")

from mstar.services.engines.attention import AttentionBatch, HeadShape, TorchPagedAttention  # noqa: E402
from mstar.services.engines.attn_triton import TritonGraphDecode  # noqa: E402
from mstar.services.engines.kernels import _store_kv_ref, rope_ref  # noqa: E402
from mstar.services.engines.layers import RotaryEmbedding  # noqa: E402
from mstar.services.engines.pages import build_csr  # noqa: E402

PS = 4


def _case(kv_lens, heads: HeadShape, device, dtype, seed=0):
    """A cache of scattered pages, a decode batch whose new tokens are the last of each
    sequence (lengths ``kv_lens``, new token included), and the qkv GEMM's output rows."""
    g = torch.Generator().manual_seed(seed)
    d, n = heads.head_dim, len(kv_lens)
    num_pages = 2 + sum(-(-n_ // PS) for n_ in kv_lens) + 3
    kv = torch.randn(2, num_pages, PS, heads.num_kv_heads, d, generator=g).to(device, dtype)
    free = torch.randperm(num_pages - 1, generator=g)[: num_pages - 1].tolist()
    free = [p + 1 for p in free]  # page 0 is scratch
    lists = []
    for n_ in kv_lens:
        k = -(-n_ // PS)
        lists.append(tuple(free[:k]))
        free = free[k:]
    table = build_csr(lists, kv_lens, PS)
    slots = torch.tensor([lst[(n_ - 1) // PS] * PS + (n_ - 1) % PS for lst, n_ in zip(lists, kv_lens, strict=True)])
    qo = torch.arange(n + 1, dtype=torch.int32)
    batch = AttentionBatch(qo, table, slots)
    width = (heads.num_qo_heads + 2 * heads.num_kv_heads) * d
    qkv = torch.randn(n, width, generator=g).to(device, dtype)
    qs, ks = heads.num_qo_heads * d, heads.num_kv_heads * d
    q, k, v = qkv.split([qs, ks, ks], dim=-1)
    q = q.view(n, heads.num_qo_heads, d)
    k, v = k.view(n, heads.num_kv_heads, d), v.view(n, heads.num_kv_heads, d)
    positions = torch.tensor([n_ - 1 for n_ in kv_lens]) + 5  # RoPE positions need not equal cache offsets
    return kv, batch, q, k, v, positions.to(device), slots.to(device)


def _reference(kv, batch, q, k, v, positions, slots, rope, heads):
    kv = kv.clone()
    qr, kr = rope_ref(rope.inv_freq.to(q.device), q.float(), k.float(), positions)
    _store_kv_ref(kv, slots, kr.to(kv.dtype), v)
    ref = TorchPagedAttention(heads, q.device)
    ref.plan(batch)
    return ref.run(qr.to(kv.dtype).float(), kv[0].float(), kv[1].float()), kv


@pytest.mark.parametrize("block_n,splits", [(16, 1), (128, 1), (16, 2), (8, 4), (16, 16)])  # KV blocks / splits
@pytest.mark.parametrize("heads", [HeadShape(6, 2, 16), HeadShape(4, 4, 32)])
def test_fused_decode_matches_rope_store_then_reference_attention(heads, block_n, splits):
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; the GPU test below covers CUDA")
    kv_lens = [1, 3, PS, PS + 1, 3 * PS + 2, 70]  # one token, inside a page, page edges, > BLOCK_N
    kv, batch, q, k, v, positions, slots = _case(kv_lens, heads, "cpu", torch.float32)
    rope = RotaryEmbedding(heads.head_dim, 10000.0, max_positions=128)
    want, want_kv = _reference(kv, batch, q, k, v, positions, slots, rope, heads)
    dec = TritonGraphDecode(heads, torch.device("cpu"), torch.float32, PS, len(kv_lens), kv.shape[1])
    dec.block_n = block_n
    dec.set_splits(splits)  # 16 splits leave most of a short sequence's splits empty
    dec.min_split_tokens = 0  # every step uses all of them
    dec.plan(batch)
    assert int(dec._indptr[-1]) == splits  # the step's split count, as the kernel reads it
    got_kv = kv.clone()
    got = dec.run_rope_store(q, k, v, positions, slots, got_kv, rope.cos_sin_cache(torch.device("cpu")))
    torch.testing.assert_close(got_kv, want_kv, atol=1e-5, rtol=1e-5)  # K rotated, V as is, at the slots
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # attention alone over the cache that now holds the new tokens gives the same result
    qr, _ = rope_ref(rope.inv_freq, q, k, positions)
    torch.testing.assert_close(dec.run(qr.contiguous(), got_kv[0], got_kv[1]), want, atol=1e-4, rtol=1e-4)
    assert not dec._count.any()  # every merge reset its counter for the next launch


@pytest.mark.parametrize("min_tokens,active", [(1000, 1), (32, 2), (16, 4), (1, 8)])
def test_a_step_uses_as_many_splits_as_its_longest_context_allows(min_tokens, active):
    """A graph built for 8 splits runs a step on fewer when its longest sequence (70 tokens)
    gives each fewer than ``min_split_tokens``: same result, counters reset, and the next
    step on the same buffers with another count is right too."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; the GPU test below covers CUDA")
    heads = HeadShape(4, 2, 16)
    kv_lens = [1, 5, 3 * PS + 2, 70]
    kv, batch, q, k, v, positions, slots = _case(kv_lens, heads, "cpu", torch.float32, seed=3)
    rope = RotaryEmbedding(heads.head_dim, 10000.0, max_positions=128)
    want, _ = _reference(kv, batch, q, k, v, positions, slots, rope, heads)
    dec = TritonGraphDecode(heads, torch.device("cpu"), torch.float32, PS, len(kv_lens), kv.shape[1])
    dec.block_n = 16
    dec.set_splits(8)
    cos_sin = rope.cos_sin_cache(torch.device("cpu"))
    for tokens, used in ((min_tokens, active), (0, 8), (min_tokens, active)):
        dec.min_split_tokens = tokens
        dec.plan(batch)
        assert int(dec._indptr[-1]) == used
        got = dec.run_rope_store(q, k, v, positions, slots, kv.clone(), cos_sin)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert not dec._count.any()


def test_split_count_rule():
    dec = TritonGraphDecode(HeadShape(4, 2, 16), torch.device("cpu"), torch.float32, PS, 2, 4)
    dec.set_splits(8)
    dec.min_split_tokens = 128
    assert [dec.splits_for_context(n) for n in (0, 127, 128, 255, 256, 600, 1024, 10**6)] == [1, 1, 1, 1, 2, 4, 8, 8]
    dec.set_splits(2)
    assert dec.splits_for_context(10**6) == 2


def test_plan_refuses_a_batch_the_graph_does_not_hold():
    heads = HeadShape(4, 2, 16)
    dec = TritonGraphDecode(heads, torch.device("cpu"), torch.float32, PS, 2, 4)
    _, batch, *_ = _case([3, 5, 2], heads, "cpu", torch.float32)
    with pytest.raises(ValueError, match="graph holds 2 / 4"):
        dec.plan(batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("splits,min_tokens", [(1, 0), (2, 0), (16, 0), (8, 128)])  # 0: all splits; 128: 4 of 8
def test_fused_decode_on_gpu_matches_the_reference_in_bf16(splits, min_tokens):
    heads = HeadShape(24, 8, 128)
    kv_lens = [1, 17, 192, 200, 513, 64, 65, 1000] * 2
    kv, batch, q, k, v, positions, slots = _case(kv_lens, heads, "cuda", torch.bfloat16)
    rope = RotaryEmbedding(heads.head_dim, 500000.0, max_positions=4096)
    want, want_kv = _reference(kv, batch, q, k, v, positions, slots, rope, heads)
    dec = TritonGraphDecode(heads, torch.device("cuda"), torch.bfloat16, PS, len(kv_lens), kv.shape[1])
    dec.set_splits(splits)
    dec.min_split_tokens = min_tokens
    dec.plan(batch)
    assert int(dec._indptr[-1]) == (splits if min_tokens == 0 else 4)  # longest context 1,000
    got_kv = kv.clone()
    for _ in range(3):  # repeated launches: each must find its split counters reset
        got = dec.run_rope_store(q, k, v, positions, slots, got_kv, rope.cos_sin_cache(torch.device("cuda")))
    torch.cuda.synchronize()
    assert not dec._count.any()
    assert (got_kv.float() - want_kv.float()).abs().max() <= 2e-2  # one bf16 rounding of the rotated K
    err = (got.float() - want).norm() / want.norm()
    assert err <= 1e-2, err


def _slot_decode(attention: str, device, dtype, lengths, span, heads: HeadShape, seed=0):
    """Qwen3-Omni's slot cache (one page of max_len rows a slot) with random K/V in every slot, a
    decode of one new token for ``lengths`` rows (slots in shuffled order, the last two rows
    padded onto the scratch slot as a CUDA graph pads them): the output and the cache after."""
    from mstar.models.qwen3_omni.cache import Decode, SlotCache
    g = torch.Generator().manual_seed(seed)
    cache = SlotCache(2, 6, 64, heads.num_kv_heads, heads.head_dim, device, dtype, attention=attention)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    n = len(lengths)
    slots = torch.tensor([4, 0, 5, 2, 1, 3][:n - 2] + [cache.scratch] * 2)
    dec = Decode(cache, slots.to(device), torch.tensor(lengths).to(device), span)
    outs = []
    for layer in range(2):
        q = torch.randn(n, heads.num_qo_heads, heads.head_dim, generator=g).to(device, dtype)
        k, v = (torch.randn(n, heads.num_kv_heads, heads.head_dim, generator=g).to(device, dtype) for _ in "kv")
        outs.append(dec.attend(layer, q, k, v))
    return torch.stack(outs), [t[: cache.scratch] for t in cache.k + cache.v]


@pytest.mark.parametrize("heads", [HeadShape(8, 2, 16), HeadShape(4, 4, 32)])
def test_the_slot_cache_decode_in_place_equals_the_gathering_one(heads):
    """Decode over Qwen3-Omni's slot cache through the Triton kernel (each slot one page, its table
    built on the device) against the torch path that gathers each row's keys: fp32 on the CPU,
    atol 1e-5; the real slots' K/V identical; rows of lengths 0 (the first token), inside a KV
    block and past it, the span longer than the longest."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; the GPU test below covers CUDA")
    lengths = [0, 7, 40, 63, 5, 5]
    want, want_kv = _slot_decode("torch", "cpu", torch.float32, lengths, 64, heads)
    got, got_kv = _slot_decode("triton", "cpu", torch.float32, lengths, 64, heads)
    torch.testing.assert_close(got[:, :-2], want[:, :-2], atol=1e-5, rtol=1e-5)
    for a, b in zip(got_kv, want_kv, strict=True):
        assert torch.equal(a, b)


def test_slot_cache_attention_choice():
    from mstar.models.qwen3_omni.cache import SlotCache
    assert SlotCache(1, 2, 8, 1, 16, "cpu", torch.float32).attention == "torch"  # auto on a CPU
    assert SlotCache(1, 2, 8, 1, 16, "cpu", torch.float32, attention="triton").attention == "triton"
    with pytest.raises(ValueError, match="attention='flash'"):
        SlotCache(1, 2, 8, 1, 16, "cpu", torch.float32, attention="flash")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_slot_cache_decode_in_place_on_gpu_in_bf16():
    """The Thinker's head shape (32 / 4 heads of 128) in bf16: the in-place kernel against the
    gathering torch path, relative error 1e-2; "auto" picks the kernel on CUDA."""
    from mstar.models.qwen3_omni.cache import SlotCache
    assert SlotCache(1, 2, 8, 4, 128, "cuda", torch.bfloat16).attention == "triton"
    heads = HeadShape(32, 4, 128)
    lengths = [0, 7, 40, 63, 17, 17]
    want, _ = _slot_decode("torch", "cuda", torch.bfloat16, lengths, 64, heads)
    got, _ = _slot_decode("triton", "cuda", torch.bfloat16, lengths, 64, heads)
    err = (got[:, :-2].float() - want[:, :-2].float()).abs().max() / want.float().abs().max()
    assert err < 1e-2, err


def test_a_device_table_decode_refuses_what_its_kernel_cannot_run():
    from mstar.services.engines.attn_triton import DeviceTableDecode
    pages, lengths = torch.tensor([0, 1]), torch.tensor([3, 5])
    with pytest.raises(ValueError, match="head_dim=8 must be a power of two >= 16"):
        DeviceTableDecode(HeadShape(4, 2, 8), 16, pages, lengths, 16)
    dec = DeviceTableDecode(HeadShape(4, 2, 16), 16, pages, lengths, 16)
    cache = torch.zeros(2 * 16, 2, 16)
    with pytest.raises(ValueError, match="3 query rows, the table has 2"):
        dec.run(torch.zeros(3, 4, 16), cache, cache)
