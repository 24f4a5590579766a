"""The action expert's joint attention as Triton kernels: its action-token queries over the prefix's
K / V (masked to the valid prefix tokens) and its own K / V, one softmax, without concatenating the
two key sets.

The expert's attention is small and awkward for a fused SDPA kernel: one KV head, 8 query heads
over 50 action tokens (400 query rows once the heads are folded into rows), ~1000 keys. A kernel
that tiles only the query rows runs a handful of thread blocks at batch 1 (cuDNN's took 58 µs a
layer on an H100; two GEMMs and a softmax 16 µs). Here the keys are split as well: program
(row block, split) attends to one slice of the prefix (split 0 also to the own keys), writing a
partial result (output, running max, sum) that a second kernel merges, writing the output straight
into the [B, T, H * D] layout o_proj reads. Scores and softmax in fp32.

``joint_attention`` is a torch custom op (one opaque node under torch.compile, captured in the
loop's CUDA graph). On a CPU the kernels run under ``TRITON_INTERPRET=1`` (the tests compare them
with ``layers.attend`` there); the model uses ``layers.attend`` on a CPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

#: rows of the query block and keys per inner iteration; warps per program; software-pipeline stages
#: of the key loop (3, Triton's default, needs 352 KB of shared memory at head_dim 256: over an H100's)
BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 64, 8, 2
#: programs to aim for (about two per SM of an H100), and the fewest key blocks a split takes
TARGET_PROGRAMS, MIN_BLOCKS_PER_SPLIT = 264, 2


@triton.jit
def _split_kernel(q_ptr, sqb, sqh, sqt,  # q [B, H, T, D] (d dense)
                  kp_ptr, vp_ptr, skb, skp, svb, svp,  # prefix K / V [B, P, D]
                  ke_ptr, ve_ptr, seb, set_, sfb, sft,  # own K / V [B, T, D]
                  valid_ptr, P,  # bool [B, P]
                  out_ptr, part_ptr, ml_ptr, qk_scale, T, R, RB, CHUNK,
                  H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // RB
    r = (pid % RB) * BM + tl.arange(0, BM)  # folded query rows: r = h * T + t
    rmask = r < R
    h, t = r // T, r % T
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + (h * sqh + t * sqt)[:, None] + d[None, :], mask=rmask[:, None], other=0.0)
    dtype = q.dtype
    m = tl.full([BM], float("-inf"), tl.float32)
    l_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, P)
    # the prefix slice, then (split 0) the own keys: one loop over n_own extra keys past P
    n_own = tl.where(split == 0, T, 0)
    for j0 in range(lo, hi + n_own, BN):
        j = j0 + tl.arange(0, BN)
        in_prefix = j < hi
        own = (j >= hi) & (j - hi < n_own)
        jo = j - hi
        ok = tl.load(valid_ptr + b * P + j, mask=in_prefix, other=0).to(tl.int1) & in_prefix
        kb = tl.load(kp_ptr + b * skb + j[:, None] * skp + d[None, :], mask=ok[:, None], other=0.0)
        kb += tl.load(ke_ptr + b * seb + jo[:, None] * set_ + d[None, :], mask=own[:, None], other=0.0)
        vb = tl.load(vp_ptr + b * svb + j[:, None] * svp + d[None, :], mask=ok[:, None], other=0.0)
        vb += tl.load(ve_ptr + b * sfb + jo[:, None] * sft + d[None, :], mask=own[:, None], other=0.0)
        if dtype == tl.float32:
            s = tl.dot(q, tl.trans(kb), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kb))
        s = tl.where((ok | own)[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no key: nothing to add
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if dtype == tl.float32:
            acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(dtype), vb)
        m = m_new
    if SPLITS == 1:
        o = out_ptr + b * (T * H * D) + (t * (H * D) + h * D)[:, None] + d[None, :]
        tl.store(o, (acc / l_sum[:, None]).to(dtype), mask=rmask[:, None])
    else:
        at = (b * SPLITS + split) * RB * BM + (pid % RB) * BM + tl.arange(0, BM)  # [B, SPLITS, RB * BM]
        tl.store(part_ptr + at[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + at * 2, m)
        tl.store(ml_ptr + at * 2 + 1, l_sum)


@triton.jit
def _merge_kernel(part_ptr, ml_ptr, out_ptr, T, R, RB,
                  H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, SPLITS: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // RB
    r = (pid % RB) * BM + tl.arange(0, BM)
    rmask = r < R
    h, t = r // T, r % T
    d = tl.arange(0, D)
    base = b * SPLITS * RB * BM + (pid % RB) * BM + tl.arange(0, BM)
    m_all = tl.full([BM], float("-inf"), tl.float32)
    for i in range(SPLITS):
        m_all = tl.maximum(m_all, tl.load(ml_ptr + (base + i * RB * BM) * 2))
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros([BM], tl.float32)
    merged = tl.zeros([BM, D], tl.float32)
    for i in range(SPLITS):
        at = base + i * RB * BM
        w = tl.exp2(tl.load(ml_ptr + at * 2) - m_all)
        total += w * tl.load(ml_ptr + at * 2 + 1)
        merged += w[:, None] * tl.load(part_ptr + at[:, None] * D + d[None, :])
    o = out_ptr + b * (T * H * D) + (t * (H * D) + h * D)[:, None] + d[None, :]
    tl.store(o, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def splits_for(batch: int, row_blocks: int, prefix_len: int) -> int:
    """Key splits for a launch: enough programs to fill the GPU, at least MIN_BLOCKS_PER_SPLIT key
    blocks each."""
    most = max(1, triton.cdiv(triton.cdiv(prefix_len, BLOCK_N), MIN_BLOCKS_PER_SPLIT))
    return max(1, min(most, triton.cdiv(TARGET_PROGRAMS, batch * row_blocks)))


@torch.library.custom_op("mstar_pi05::joint_attention", mutates_args=())
def joint_attention(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, own_k: torch.Tensor,
                    own_v: torch.Tensor, prefix_valid: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, D] (RoPE applied), prefix_k / prefix_v [B, P, D], own_k / own_v [B, T, D] (the one
    KV head), prefix_valid bool [B, P] -> [B, T, H * D]: softmax(q k^T / sqrt(D)) v over the valid
    prefix keys and every own key."""
    b, h, t, d = q.shape
    p = prefix_k.shape[1]
    for name, x in (("q", q), ("prefix_k", prefix_k), ("prefix_v", prefix_v), ("own_k", own_k), ("own_v", own_v)):
        if x.stride(-1) != 1:
            raise ValueError(f"joint_attention: {name} must be dense in its last dim")
    rows = h * t
    rb = triton.cdiv(rows, BLOCK_M)
    splits = splits_for(b, rb, p)
    chunk = max(BLOCK_N, triton.cdiv(triton.cdiv(p, splits), BLOCK_N) * BLOCK_N)
    splits = triton.cdiv(p, chunk) if p else 1
    out = torch.empty(b, t, h * d, dtype=q.dtype, device=q.device)
    if splits > 1:
        part = torch.empty(b, splits, rb * BLOCK_M, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(b, splits, rb * BLOCK_M, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out
    qk_scale = d**-0.5 * math.log2(math.e)
    _split_kernel[(b * rb, splits)](
        q, q.stride(0), q.stride(1), q.stride(2),
        prefix_k, prefix_v, prefix_k.stride(0), prefix_k.stride(1), prefix_v.stride(0), prefix_v.stride(1),
        own_k, own_v, own_k.stride(0), own_k.stride(1), own_v.stride(0), own_v.stride(1),
        prefix_valid, p, out, part, ml, qk_scale, t, rows, rb, chunk,
        H=h, D=d, BM=BLOCK_M, BN=BLOCK_N, SPLITS=splits, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if splits > 1:
        _merge_kernel[(b * rb,)](part, ml, out, t, rows, rb, H=h, D=d, BM=BLOCK_M, SPLITS=splits, num_warps=NUM_WARPS)
    return out


@joint_attention.register_fake
def _(q, prefix_k, prefix_v, own_k, own_v, prefix_valid):
    b, h, t, d = q.shape
    return q.new_empty(b, t, h * d)
