"""Decode attention for captured CUDA graphs as one Triton kernel that also applies RoPE and
writes the new token's K/V into the paged cache.

A decode step of a GQA layer otherwise launches three kernels after the qkv GEMM: RoPE on q/k,
the K/V store, and the attention kernel. At decode sizes each is latency-bound (a few µs of
launch and ramp for little work), so the fused kernel saves two launches a layer. Its programs
are (sequence, KV head, KV split): each rotates its KV head's query heads and new key with the
fp32 cos|sin table, split 0 stores K/V at the token's cache slot, and each split attends to its
slice of the cached prefix through the page table (split 0 also to the new token, from registers,
so no program reads back what it just wrote). With several splits each writes a partial result
(output, running max, sum) and the last split of its (sequence, KV head) to finish — an atomic
counter, reset by that split — merges them in the same launch: few sequences with long contexts
still spread over the GPU without a second kernel.

Same page-table layout as FlashInfer (CSR ``indptr`` / ``indices`` / ``last_page_len``, NHD
pages), same rotation (neox halves, the fp32 cos|sin table of ``RotaryEmbedding``), bf16 or fp16
caches on the GPU. On a CPU it runs under ``TRITON_INTERPRET=1`` (fp32), which the tests use to
check it against the torch reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mstar.services.engines.attention import AttentionBatch, HeadShape
from mstar.services.engines.pdl import gdc_launch_dependents, gdc_wait, launch_options
from mstar.services.engines.rowscale_triton import _row_rsqrt

#: Launch configuration: KV tokens per inner iteration (``BLOCK_N_FEW`` for graphs of fewer than
#: ``MANY_SEQS`` sequences), warps per program, software-pipeline stages of the KV loop (None:
#: Triton's default). Instances copy them; benchmarks override. On an H100 at 24/8 heads
#: (bench/results/engines/decode_attn.json) 128-token blocks beat 64 at 16 sequences (31.9 vs
#: 35.9 µs a layer at 1k context, 103 vs 124 at 4k) and lose at 64 (27.2 vs 23.2 at 192).
BLOCK_N, BLOCK_N_FEW, MANY_SEQS = 64, 128, 32
NUM_WARPS = 4
NUM_STAGES: int | None = None
#: Split-KV: programs wanted per launch (about two per SM of an H100) and the most splits per
#: (sequence, KV head). Measured on an H100 (bench/results/engines/decode_attn_split.json): batch 1
#: at 8 splits 7.5 / 9.3 / 18.9 µs a layer at contexts 192 / 1k / 4k (1 split: 7.5 / 23.3 / 83.0);
#: batch 16 at 2 splits 12.7 / 32.0 / 98.1 (1: 11.5 / 32.8 / 107.1).
TARGET_PROGRAMS, MAX_SPLITS = 256, 8
#: A graph's kernel is launched with its batch's split count, but each step uses only as many as
#: give the longest sequence at least this many cached tokens a split (a power of two, >= 1): at
#: short contexts a split's fixed cost outweighs its share of the work (batch 16 at context 192:
#: 1 split 11.5 µs a layer, 2 splits 12.7). The step's count reaches the kernel through the page
#: table's indptr buffer (one element past the sequences), so it changes without a new graph.
MIN_SPLIT_TOKENS = 128


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, q_stride, kv_stride,  # q [n, Hq, D], k / v [n, Hkv, D]: rows strided, heads dense
    pos_ptr, slot_ptr, cos_sin_ptr,  # int64 [n], int64 [n], fp32 [positions, D] (cos | sin)
    k_cache_ptr, v_cache_ptr,  # [pages * page_size, Hkv, D]
    indptr_ptr, indices_ptr, last_ptr,  # int32 CSR page table
    out_ptr, qk_scale,  # out [n, Hq, D]; softmax scale x log2(e)
    part_ptr, ml_ptr, count_ptr,  # split-KV: fp32 [n, Hkv, S, GP, D] partial outputs, [n, Hkv, S, 2, GP] max / sum;
    # int32 [n, Hkv] finished splits (zero between launches: the last split resets it); with SPLITS > 1,
    # indptr[n + 1] holds the step's split count (<= SPLITS)
    res_ptr, res_stride, hidden, eps,  # ROWSCALE: q / k / v times 1 / rms(res[b]) (the layer's un-normalised input)
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    BLOCK: tl.constexpr, FUSED: tl.constexpr, SPLITS: tl.constexpr, ROWSCALE: tl.constexpr, HIDDEN_P2: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the qkv GEMM (pdl.py)
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    dtype = k_cache_ptr.dtype.element_ty
    d = tl.arange(0, D)
    g = tl.arange(0, GP)
    gmask = g < G
    qrow = b * q_stride + (h * G + g)[:, None] * D
    # Up to the wait: what the qkv GEMM does not write (page table, RoPE table, the residual row).
    first = tl.load(indptr_ptr + b)
    kv_len = (tl.load(indptr_ptr + b + 1) - first - 1) * PS + tl.load(last_ptr + b)
    if FUSED:
        half: tl.constexpr = D // 2
        pos = tl.load(pos_ptr + b)
        partner = (d + half) % D
        cos = tl.load(cos_sin_ptr + pos * D + d % half)
        sin = tl.load(cos_sin_ptr + pos * D + half + d % half)
        sign = tl.where(d < half, -1.0, 1.0)
        if ROWSCALE:
            r = _row_rsqrt(res_ptr, b, res_stride, hidden, eps, HIDDEN_P2)
        else:
            r = 1.0
    if PDL:
        gdc_wait()
    q = tl.load(q_ptr + qrow + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    if FUSED:
        q_pair = tl.load(q_ptr + qrow + partner[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
        q = ((q * cos[None, :] + sign[None, :] * q_pair * sin[None, :]) * r).to(dtype).to(tl.float32)
        k_row = k_ptr + b * kv_stride + h * D
        k_new = tl.load(k_row + d).to(tl.float32) * cos + sign * tl.load(k_row + partner).to(tl.float32) * sin
        k_new = (k_new * r).to(dtype)
        v_new = (tl.load(v_ptr + b * kv_stride + h * D + d).to(tl.float32) * r).to(dtype)
        dst = (tl.load(slot_ptr + b) * HKV + h) * D + d
        mine = d < tl.where(split == 0, D, 0)  # split 0 stores the new K/V and counts the new token
        tl.store(k_cache_ptr + dst, k_new, mask=mine)
        tl.store(v_cache_ptr + dst, v_new, mask=mine)
        first_split = split == 0
        m = tl.where(first_split, tl.sum(q * k_new.to(tl.float32)[None, :], 1) * qk_scale, float("-inf"))
        l_sum = tl.where(first_split, tl.full([GP], 1.0, tl.float32), 0.0)
        acc = tl.where(first_split, tl.zeros([GP, D], tl.float32) + v_new.to(tl.float32)[None, :], 0.0)
        n_cached = kv_len - 1
    else:
        m = tl.full([GP], float("-inf"), tl.float32)
        l_sum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        n_cached = kv_len
    qd = q.to(dtype)
    if SPLITS == 1:
        active = 1
    else:
        active = tl.load(indptr_ptr + tl.num_programs(0) + 1)  # splits past it have no work
    chunk = tl.cdiv(n_cached, active)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_cached)
    for t0 in range(lo, hi, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tmask = t < hi
        page = tl.load(indices_ptr + first + t // PS, mask=tmask, other=0).to(tl.int64)
        row = ((page * PS + t % PS) * HKV + h) * D
        kb = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
        vb = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
        if dtype == tl.float32:
            s = tl.dot(qd, tl.trans(kb), input_precision="ieee")
        else:
            s = tl.dot(qd, tl.trans(kb))
        s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if dtype == tl.float32:
            pv = tl.dot(p, vb, input_precision="ieee")
        else:
            pv = tl.dot(p.to(dtype), vb)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if PDL:
        gdc_launch_dependents()  # o_proj may launch; it waits for this kernel's end before reading out
    orow = b * (HKV * G * D) + (h * G + g)[:, None] * D
    if SPLITS == 1:
        tl.store(out_ptr + orow + d[None, :], (acc / l_sum[:, None]).to(dtype), mask=gmask[:, None])
    elif split < active:
        if active == 1:
            tl.store(out_ptr + orow + d[None, :], (acc / l_sum[:, None]).to(dtype), mask=gmask[:, None])
        else:
            # Publish this split's partial result; the last split of (b, h) to finish merges them all.
            pair = b * HKV + h
            mine_at = pair * SPLITS + split
            tl.store(part_ptr + (mine_at * GP + g[:, None]) * D + d[None, :], acc)
            tl.store(ml_ptr + mine_at * 2 * GP + g, m)
            tl.store(ml_ptr + mine_at * 2 * GP + GP + g, l_sum)
            tl.debug_barrier()  # every thread's stores precede the release below
            done = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel")
            if done == active - 1:
                m_all = tl.full([GP], float("-inf"), tl.float32)
                for i in range(0, active):
                    m_all = tl.maximum(m_all, tl.load(ml_ptr + (pair * SPLITS + i) * 2 * GP + g, cache_modifier=".cg"))
                m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
                total = tl.zeros([GP], tl.float32)
                merged = tl.zeros([GP, D], tl.float32)
                for i in range(0, active):
                    at = pair * SPLITS + i
                    w = tl.exp2(tl.load(ml_ptr + at * 2 * GP + g, cache_modifier=".cg") - m_all)
                    total += w * tl.load(ml_ptr + at * 2 * GP + GP + g, cache_modifier=".cg")
                    merged += w[:, None] * tl.load(part_ptr + (at * GP + g[:, None]) * D + d[None, :],
                                                   cache_modifier=".cg")
                tl.store(out_ptr + orow + d[None, :], (merged / total[:, None]).to(dtype), mask=gmask[:, None])
                tl.atomic_xchg(count_ptr + pair, 0)  # ready for the next launch


def _padded_group(heads: HeadShape) -> int:
    """Query heads per KV head, padded for tl.dot (at least 16 rows)."""
    return max(16, triton.next_power_of_2(heads.group))


def splits_for(batch_size: int, kv_heads: int) -> int:
    """KV splits per (sequence, KV head): enough programs for about ``TARGET_PROGRAMS``, at most
    ``MAX_SPLITS``, a power of two."""
    want = max(1, TARGET_PROGRAMS // (batch_size * kv_heads))
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1))


def active_splits(splits: int, longest: int, min_tokens: int = MIN_SPLIT_TOKENS) -> int:
    """Splits a step uses of a launch's ``splits`` when its longest sequence holds ``longest``
    tokens: the largest power of two <= longest / ``min_tokens``, within [1, ``splits``] (all of
    them when ``min_tokens`` is 0)."""
    want = longest // min_tokens if min_tokens > 0 else splits
    return max(1, min(splits, 1 << max(0, want.bit_length() - 1)))


def _check_rows(t: torch.Tensor, heads: int, d: int, what: str) -> None:
    if t.dim() != 3 or t.shape[1:] != (heads, d) or t.stride()[1:] != (d, 1):
        raise ValueError(f"{what}: need [n, {heads}, {d}] with dense heads, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")


def _attend(cfg, q, k, v, positions, slots, kv_layer, cos_sin, fused: bool, row_rms, table, work) -> torch.Tensor:
    """One launch of ``_decode_kernel``: ``cfg`` gives heads, page_size, splits, block_n, num_warps,
    num_stages and pdl; ``table`` the int32 (indptr, indices, last) buffers; ``work`` the split-KV
    (count, part, ml) buffers."""
    h = cfg.heads
    d = h.head_dim
    _check_rows(q, h.num_qo_heads, d, "q")
    n = q.shape[0]
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    out = torch.empty((n, h.num_qo_heads, d), dtype=k_cache.dtype, device=q.device)
    sp = cfg.splits
    count, part, ml = work
    part, ml = (part, ml) if sp > 1 else (out, out)
    res, eps = row_rms if row_rms is not None else (q, 0.0)
    if row_rms is not None and (res.dim() != 2 or res.shape[0] != n or res.stride(1) != 1):
        raise ValueError(f"row_rms: need [{n}, hidden] with dense rows, got shape {tuple(res.shape)}")
    indptr, indices, last = table
    _decode_kernel[(n, h.num_kv_heads, sp)](
        q, k, v, q.stride(0), k.stride(0), positions, slots, cos_sin, k_cache, v_cache,
        indptr, indices, last, out, 1.0 / math.sqrt(d) * math.log2(math.e), part, ml, count,
        res, res.stride(0), res.shape[-1], eps,
        HKV=h.num_kv_heads, G=h.group, GP=_padded_group(h), D=d, PS=cfg.page_size, BLOCK=cfg.block_n,
        FUSED=fused, SPLITS=sp, ROWSCALE=row_rms is not None,
        HIDDEN_P2=triton.next_power_of_2(res.shape[-1]) if row_rms is not None else 1, PDL=cfg.pdl,
        num_warps=cfg.num_warps, **({} if cfg.num_stages is None else {"num_stages": cfg.num_stages}),
        **launch_options(cfg.pdl),
    )
    return out


class DeviceTableDecode:
    """Attention alone (every row's new K/V already in the cache) over a page table built on the
    device by the caller, for one forward pass: a cache whose table is not a host page list, such
    as Qwen3-Omni's slot cache (one page of ``max_len`` rows per slot, ``models/qwen3_omni/cache.py``),
    inside a CUDA graph's body. ``pages`` [n] (int) and ``lengths`` [n] (tokens of each row, its new
    one included) are device tensors; ``longest`` bounds every length (a host int): the pass uses
    as many KV splits of the batch's count as give that length ``MIN_SPLIT_TOKENS`` a split. Its
    buffers are made here, once a pass, and every layer's launch shares them."""

    pdl = False

    def __init__(self, heads: HeadShape, page_size: int, pages: torch.Tensor, lengths: torch.Tensor, longest: int):
        if heads.head_dim < 16 or heads.head_dim & (heads.head_dim - 1):
            raise ValueError(f"head_dim={heads.head_dim} must be a power of two >= 16 for the Triton decode kernel")
        n, dev = pages.shape[0], pages.device
        self.heads, self.page_size, self.rows = heads, page_size, n
        self.block_n = BLOCK_N_FEW if n < MANY_SEQS else BLOCK_N
        self.num_warps, self.num_stages = NUM_WARPS, NUM_STAGES
        self.splits = splits_for(n, heads.num_kv_heads)
        indptr = torch.arange(n + 2, dtype=torch.int32, device=dev)
        indptr[-1:].fill_(active_splits(self.splits, longest))  # a kernel, not a host copy: this may run inside a graph capture
        self.table = (indptr, pages.to(torch.int32), lengths.to(torch.int32))
        gp, kv = _padded_group(heads), heads.num_kv_heads
        rows = n * kv * self.splits
        self.work = (torch.zeros(n * kv, dtype=torch.int32, device=dev),
                     torch.empty(rows * gp * heads.head_dim, dtype=torch.float32, device=dev),
                     torch.empty(rows * 2 * gp, dtype=torch.float32, device=dev))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [n, Hq, D] (dense heads) over k / v caches [pages * page_size, Hkv, D] -> [n, Hq, D]."""
        if q.shape[0] != self.rows:
            raise ValueError(f"{q.shape[0]} query rows, the table has {self.rows}")
        unused = self.table[2]
        return _attend(self, q, q, q, unused, unused, (k_cache, v_cache), unused, False, None, self.table, self.work)


class TritonGraphDecode:
    """Decode attention for one CUDA-graph batch size, RoPE and the K/V store fused in
    (``run_rope_store``); ``run`` is attention alone over a cache already holding the new K/V.
    ``plan`` (outside the graph) refills the fixed page-table buffers the graph reads."""

    name = "triton-graph"
    fuses_rope_store = True

    def __init__(self, heads: HeadShape, device: torch.device, dtype: torch.dtype, page_size: int,
                 batch_size: int, max_pages: int):
        if heads.head_dim & (heads.head_dim - 1):
            raise ValueError(f"head_dim={heads.head_dim} must be a power of two for the Triton decode kernel")
        self.heads, self.dtype, self.page_size, self._device = heads, dtype, page_size, device
        i32 = dict(dtype=torch.int32, device=device)
        # CSR indptr of the graph's sequences, then the step's split count
        self._indptr = torch.ones(batch_size + 2, **i32)
        self._indices = torch.zeros(max_pages, **i32)
        self._last = torch.ones(batch_size, **i32)
        self._indptr[: batch_size + 1] = torch.arange(batch_size + 1, **i32)  # valid before the first plan: page 0, 1 token
        self.block_n = BLOCK_N_FEW if batch_size < MANY_SEQS else BLOCK_N
        self.num_warps, self.num_stages = NUM_WARPS, NUM_STAGES
        self.batch_size = batch_size
        self.splits = 1
        self.min_split_tokens = MIN_SPLIT_TOKENS
        #: launch as a programmatic dependent of the kernel ahead (the qkv GEMM; pdl.py). Set by
        #: the graphs where ``pdl_unavailable_reason`` is None; the kernel after it must be an
        #: ordinary launch or wait on it.
        self.pdl = False
        self._part = self._ml = None
        self._count = torch.zeros(batch_size * heads.num_kv_heads, dtype=torch.int32, device=device)
        self.set_splits(splits_for(batch_size, heads.num_kv_heads))

    def set_splits(self, splits: int) -> None:
        """Split each sequence's KV range over up to ``splits`` programs (a power of two; each
        step uses as many as ``min_split_tokens`` allows), merged by the last to finish;
        allocates the partial-result buffers (outside graph capture)."""
        if splits < 1 or splits & (splits - 1):
            raise ValueError(f"splits={splits} must be a power of two")
        self.splits = splits
        if splits > 1:
            h, gp = self.heads, _padded_group(self.heads)
            rows = self.batch_size * h.num_kv_heads * splits
            self._part = torch.empty(rows * gp * h.head_dim, dtype=torch.float32, device=self._device)
            self._ml = torch.empty(rows * 2 * gp, dtype=torch.float32, device=self._device)

    def plan(self, batch: AttentionBatch) -> None:
        """Non-blocking copies from pinned memory, stream-ordered before the replay."""
        t = batch.table
        n = t.kv_indices.shape[0]
        if t.kv_indptr.shape[0] != self._indptr.shape[0] - 1 or n > self._indices.shape[0]:
            raise ValueError(f"plan for {t.batch_size} sequences / {n} pages, graph holds "
                             f"{self._indptr.shape[0] - 2} / {self._indices.shape[0]}")
        indptr = torch.empty(self._indptr.shape, dtype=torch.int32)
        indptr[:-1] = t.kv_indptr
        indptr[-1] = self.splits_for_context(max(t.kv_lens, default=1))
        pin = self._device.type == "cuda"
        for dst, src in ((self._indptr, indptr), (self._indices[:n], t.kv_indices), (self._last, t.kv_last_page_len)):
            dst.copy_(src.pin_memory() if pin else src, non_blocking=pin)

    def splits_for_context(self, longest: int) -> int:
        """Splits a step uses when its longest sequence holds ``longest`` tokens (``active_splits``
        with this graph's ``min_split_tokens``)."""
        return active_splits(self.splits, longest, self.min_split_tokens)

    def _launch(self, q, k, v, positions, slots, kv_layer, cos_sin, fused: bool, row_rms=None) -> torch.Tensor:
        if q.shape[0] != self._last.shape[0]:
            raise ValueError(f"{q.shape[0]} query rows, graph batch is {self._last.shape[0]}")
        return _attend(self, q, k, v, positions, slots, kv_layer, cos_sin, fused, row_rms,
                       (self._indptr, self._indices, self._last), (self._count, self._part, self._ml))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        unused = self._last  # the fused path's k / v / positions / slots / table arguments
        return self._launch(q, q, q, unused, unused, (k_cache, v_cache), unused, fused=False)

    def run_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor, kv_layer: torch.Tensor, cos_sin: torch.Tensor,
                       row_rms: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """Un-rotated q [n, Hq, D], k / v [n, Hkv, D] (views of the qkv GEMM's output), RoPE
        ``positions`` and cache ``slots`` [n] int64 -> attention output [n, Hq, D]; K/V land in
        ``kv_layer`` ([k|v, page, slot, Hkv, D]) at ``slots``.

        ``row_rms`` (``x`` [n, hidden], eps): the GEMM read ``x`` un-normalised (its RMSNorm weight
        folded into the projection), so q, k and v of row b are first scaled by
        1 / sqrt(mean(x[b]²) + eps), which the kernel computes."""
        h = self.heads
        _check_rows(k, h.num_kv_heads, h.head_dim, "k")
        _check_rows(v, h.num_kv_heads, h.head_dim, "v")
        if k.stride(0) != v.stride(0) or k.dtype != kv_layer.dtype:
            raise ValueError("k and v must share a row stride and the cache's dtype")
        return self._launch(q, k, v, positions, slots, kv_layer, cos_sin, fused=True, row_rms=row_rms)
