"""π0.5's action-expert attention as one Triton kernel (and a merge of its key splits).

At every layer of every Euler step the expert's action tokens (50 at full size) attend, with their 8
query heads over one KV head, to the prefix's cached keys (968, the padded ones masked) and to their
own keys. As torch ops that is a concatenation of the prefix K / V with the own ones, a scores GEMM,
a masked softmax and a PV GEMM, each latency-bound at these sizes (a few MFLOP). Here a program takes
BLOCK_M query rows of one (sequence, KV head) — its query heads' rows in (token, head) order, as they
lie in the rotated q — and one split of the keys: the prefix's read in place from its cache (invalid
ones masked), then the own keys. It keeps an online softmax in fp32. With one split it writes the
output; with several each writes its partial output, max and sum, and ``_merge_kernel`` combines
them. RoPE stays outside (one fused elementwise kernel for q and k under torch.compile): rotating
[BLOCK_N, 256] tiles on load spilled registers. On a CPU the kernels run under
``TRITON_INTERPRET=1`` in fp32 (the tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

#: Launch configuration: query rows per program, keys per inner iteration, warps, software-pipeline
#: stages of the key loops, and the key splits aimed for (programs wanted per launch, at most
#: MAX_SPLITS splits). Benchmarks override them. At head_dim 256 a program holds its rows' fp32
#: output and a K and a V tile in registers: 32 rows x 64 keys over 8 warps is the largest tile that
#: compiles for sm_90 without spilling (255 registers a thread).
BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 32, 64, 8, 2
TARGET_PROGRAMS, MAX_SPLITS = 132, 8


@triton.jit
def _online_softmax(q, k, v, allowed, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """One key block into the running (max, sum, output) of each query row."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(allowed[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key allowed yet: nothing to rescale
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit
def _attn_kernel(
    q_ptr, sq_b, sq_t, sq_h,  # q [B, T, H, D] (rotated; last dim dense)
    k_ptr, sk_b, sk_t, sk_h,  # own k [B, T, Hkv, D] (rotated)
    v_ptr, sv_b, sv_t, sv_h,  # own v [B, T, Hkv, D]
    pk_ptr, spk_b, spk_h, spk_s,  # prefix K [B, Hkv, P, D]
    pv_ptr, spv_b, spv_h, spv_s,  # prefix V [B, Hkv, P, D]
    valid_ptr, sval_b,  # uint8 [B, P]: 1 where a prefix key may be attended to
    out_ptr, so_b, so_t,  # out [B, T, H * D]
    part_ptr, ml_ptr,  # fp32 [B * Hkv, SPLITS, R, BLOCK_D] partial outputs, [B * Hkv, SPLITS, R, 2] max / sum
    P, T, KV_HEADS, keys_per_split, qk_scale,  # qk_scale: softmax scale x log2(e)
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // KV_HEADS
    j = bh % KV_HEADS
    R = T * G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    tok = rows // G
    head = j * G + rows % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    mask_q = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * sq_b + tok[:, None] * sq_t + head[:, None] * sq_h + d[None, :], mask=mask_q, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, P + T)
    p_hi = tl.minimum(hi, P)
    for n0 in range(lo, p_hi, BLOCK_N):  # the split's prefix keys, read in place
        n = n0 + tl.arange(0, BLOCK_N)
        ok = n < p_hi
        mk = ok[:, None] & d_ok[None, :]
        k = tl.load(pk_ptr + b * spk_b + j * spk_h + n[:, None] * spk_s + d[None, :], mask=mk, other=0.0)
        v = tl.load(pv_ptr + b * spv_b + j * spv_h + n[:, None] * spv_s + d[None, :], mask=mk, other=0.0)
        allowed = ok & (tl.load(valid_ptr + b * sval_b + n, mask=ok, other=0) != 0)
        m_i, l_i, acc = _online_softmax(q, k, v, allowed, m_i, l_i, acc, qk_scale, IEEE)
    for n0 in range(tl.maximum(lo, P), hi, BLOCK_N):  # then its own keys
        o = n0 - P + tl.arange(0, BLOCK_N)
        ok = o < hi - P
        mk = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + b * sk_b + o[:, None] * sk_t + j * sk_h + d[None, :], mask=mk, other=0.0)
        v = tl.load(v_ptr + b * sv_b + o[:, None] * sv_t + j * sv_h + d[None, :], mask=mk, other=0.0)
        m_i, l_i, acc = _online_softmax(q, k, v, ok, m_i, l_i, acc, qk_scale, IEEE)
    if SPLIT:
        at = (bh * tl.num_programs(1) + split) * R + rows
        tl.store(part_ptr + at[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + at * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + at * 2 + 1, l_i, mask=row_ok)
    else:
        dst = out_ptr + b * so_b + tok[:, None] * so_t + head[:, None] * D + d[None, :]
        tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_q)


@triton.jit
def _merge_kernel(part_ptr, ml_ptr, out_ptr, so_b, so_t, T, KV_HEADS, SPLITS,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // KV_HEADS
    j = bh % KV_HEADS
    R = T * G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    d = tl.arange(0, BLOCK_D)
    big = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(SPLITS):
        big = tl.maximum(big, tl.load(ml_ptr + ((bh * SPLITS + s) * R + rows) * 2, mask=row_ok, other=float("-inf")))
    big = tl.where(big == float("-inf"), 0.0, big)
    num = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    for s in range(SPLITS):
        at = (bh * SPLITS + s) * R + rows
        w = tl.exp2(tl.load(ml_ptr + at * 2, mask=row_ok, other=float("-inf")) - big)
        den += w * tl.load(ml_ptr + at * 2 + 1, mask=row_ok, other=0.0)
        num += w[:, None] * tl.load(part_ptr + at[:, None] * BLOCK_D + d[None, :], mask=row_ok[:, None], other=0.0)
    den = tl.where(row_ok, den, 1.0)  # rows past the last: nothing was summed
    tok = rows // G
    head = j * G + rows % G
    dst = out_ptr + b * so_b + tok[:, None] * so_t + head[:, None] * D + d[None, :]
    tl.store(dst, (num / den[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < D)[None, :])


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def splits_for(keys: int, row_blocks: int, block_n: int = BLOCK_N) -> int:
    """Key splits per (sequence, KV head): enough programs for about TARGET_PROGRAMS, at most
    MAX_SPLITS and one key block a split."""
    want = -(-TARGET_PROGRAMS // row_blocks)
    return max(1, min(want, MAX_SPLITS, -(-keys // block_n)))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, prefix_valid: torch.Tensor, *,
              block_m: int | None = None, block_n: int | None = None, splits: int | None = None,
              num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """The expert's joint attention: q [B, T, H, D], k / v [B, T, Hkv, D] (RoPE applied; any strides
    with a dense last dim), prefix K / V [B, Hkv, P, D] (the cache), prefix_valid [B, P] bool ->
    [B, T, H * D] in q's dtype: softmax over the valid prefix keys and all own keys of
    (q . k) / sqrt(D), times the values."""
    b, t, h, d = q.shape
    hkv, p = prefix_k.shape[1], prefix_k.shape[2]
    if h % hkv or k.shape != (b, t, hkv, d) or v.shape != k.shape or prefix_v.shape != prefix_k.shape:
        raise ValueError(f"attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"prefix K {tuple(prefix_k.shape)}, prefix V {tuple(prefix_v.shape)}")
    block_m, block_n = block_m or BLOCK_M, block_n or BLOCK_N
    q, k, v = map(_dense_last, (q, k, v))
    prefix_k, prefix_v = _dense_last(prefix_k), _dense_last(prefix_v)
    valid = prefix_valid.view(torch.uint8) if prefix_valid.dtype == torch.bool else prefix_valid.to(torch.uint8)
    g = h // hkv
    rows = t * g
    row_blocks = -(-rows // block_m)
    keys = p + t
    n_splits = splits or splits_for(keys, row_blocks * b * hkv, block_n)
    per_split = triton.cdiv(triton.cdiv(keys, n_splits), block_n) * block_n  # whole key blocks a split
    n_splits = triton.cdiv(keys, per_split)
    block_d = triton.next_power_of_2(d)
    out = q.new_empty(b, t, h * d)
    split = n_splits > 1
    part = torch.empty(b * hkv, n_splits, rows, block_d, dtype=torch.float32, device=q.device) if split else out
    ml = torch.empty(b * hkv, n_splits, rows, 2, dtype=torch.float32, device=q.device) if split else out
    warps = num_warps or NUM_WARPS
    _attn_kernel[(row_blocks, n_splits, b * hkv)](
        q, q.stride(0), q.stride(1), q.stride(2),
        k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2),
        prefix_k, prefix_k.stride(0), prefix_k.stride(1), prefix_k.stride(2),
        prefix_v, prefix_v.stride(0), prefix_v.stride(1), prefix_v.stride(2),
        valid, valid.stride(0),
        out, out.stride(0), out.stride(1),
        part, ml,
        p, t, hkv, per_split, d**-0.5 * math.log2(math.e),
        G=g, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split,
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=num_stages or NUM_STAGES)
    if split:
        _merge_kernel[(row_blocks, b * hkv)](part, ml, out, out.stride(0), out.stride(1), t, hkv, n_splits,
                                             G=g, D=d, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=warps)
    return out
