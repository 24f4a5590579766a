"""The first half of a V-JEPA 2 block after its qkv GEMM, in one kernel: split the GEMM's
``[T, 3C]`` rows into q, k and v, rotating q and k by ``rope.apply``'s formula on the way (the
tiled tables, so each element uses its own cos / sin column, not its pair's). q comes out dense
(``[B, N, heads, head_dim]``, the layout attention kernels take); k and v go wherever the caller
says, e.g. straight into a rollout's K/V cache, so a cached step copies nothing afterwards.

Written by hand because torch.compile's kernel for the same expression (a stack of the pairs,
their select and the split) ran at ~0.5 TB/s on an H200: 109 us a ViT-L layer at 8192 tokens, plus
52 us for v's copy. Pairs are swapped in registers (split / join of each loaded tile), so every
load and store is a dense vector access. Math in fp32, rounded once (eagerly each of the
expression's three steps rounds to bf16). On a CPU it runs under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T, BLOCK_C = 16, 128


@triton.jit
def _rotated(src, c, mask, cos, sin, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    x = tl.load(src + c, mask=mask, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_C // 2, 2)))
    rot = tl.reshape(tl.join(-odd, even), (BLOCK_T, BLOCK_C))  # rotate_pairs: (x0, x1) -> (-x1, x0)
    return x * cos + rot * sin


@triton.jit
def _qkv_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, T, R, N, kv_sb, kv_sn, kv_sh,
                     C: tl.constexpr, HD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (t < T) & (c < C)
    row = qkv_ptr + t * (3 * C)
    d = c % HD
    tab = (t % R) * HD + d  # the token's table row: R rows repeat over the T tokens
    cos = tl.load(cos_ptr + tab, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tab, mask=mask, other=0.0).to(tl.float32)
    q = _rotated(row, c, mask, cos, sin, BLOCK_T, BLOCK_C)
    tl.store(q_ptr + t * C + c, q.to(q_ptr.dtype.element_ty), mask=mask)
    kv = (t // N) * kv_sb + (t % N) * kv_sn + (c // HD) * kv_sh + d  # token t = (row, position)
    k = _rotated(row + C, c, mask, cos, sin, BLOCK_T, BLOCK_C)
    tl.store(k_ptr + kv, k.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + kv, tl.load(row + 2 * C + c, mask=mask), mask=mask)


def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
             kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv ``[B, N, 3C]`` (dense) and the RoPE tables ``[..., head_dim]`` (dense, R rows of which
    token t uses row t mod R: ``[N, 1, hd]`` for every row alike, ``[B, N, 1, hd]`` per row) -> q, k,
    v ``[B, N, heads, head_dim]``, q and k rotated. ``kv_out``: where k and v go (two ``[B, N,
    heads, head_dim]`` views with the same strides and dense head_dim, e.g. a cache's slots seen
    through a transpose); they are returned as k and v."""
    B, N, three_c = qkv.shape
    C = three_c // 3
    hd = C // heads
    T = B * N
    if not qkv.is_contiguous() or three_c % 3 or C % heads or hd % 2:
        raise ValueError(f"qkv_rope needs dense [B, N, 3C] rows with C a multiple of heads, got {tuple(qkv.shape)}")
    cos, sin = cos.reshape(-1, hd), sin.reshape(-1, hd)
    R = cos.shape[0]
    if sin.shape[0] != R or T % R or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"RoPE tables of {R} rows for {T} tokens")
    q = torch.empty((B, N, heads, hd), dtype=qkv.dtype, device=qkv.device)
    if kv_out is None:
        k, v = torch.empty_like(q), torch.empty_like(q)
    else:
        k, v = kv_out
        if k.shape != q.shape or v.shape != q.shape or v.stride() != k.stride() or k.stride(3) != 1 or k.dtype != v.dtype:
            raise ValueError(f"kv_out must be two [B, N, heads, head_dim] views alike, got {tuple(k.shape)} / {tuple(v.shape)}")
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C))
    _qkv_rope_kernel[grid](qkv, cos, sin, q, k, v, T, R, N, k.stride(0), k.stride(1), k.stride(2),
                           C=C, HD=hd, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
    return q, k, v
