"""The elementwise work of a decoder layer behind one interface: RMSNorm (with the residual
add fused in), rotary embedding, SiLU·mul, and storing new K/V in the paged cache.

- ``TorchOps``: the reference, plain torch ops (CPU, the fp32 parity tests). Each call is a
  chain of small kernels on CUDA (RMSNorm alone is six).
- ``FlashInferOps``: FlashInfer's fused CUDA kernels, one launch per call; RoPE rotates q and
  k in place inside the fused qkv output and K/V reach the cache in one scatter. In place:
  ``add_rms_norm`` overwrites both of its inputs.
(A torch.compile kernel set was measured against FlashInfer and removed: on par at batch 1/16,
0.15 ms slower at 64, 19 s of compile per engine start; bench/results/HISTORY.md.)

A decode step runs these 5 calls per layer between the 4 GEMMs and attention, so on a GPU
their launch count, not their bytes, is what they cost.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # layers imports this module
    from mstar.services.engines.layers import RotaryEmbedding

KNOWN = ("auto", "torch", "flashinfer")


class Ops(Protocol):
    name: str
    in_place: bool  # add_rms_norm / rope may overwrite their inputs
    position_table: bool  # rope reads RotaryEmbedding.cos_sin_cache: positions < its max_positions

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2d] -> silu(x[..., :d]) * x[..., d:]."""
        ...

    def rope(self, rope: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, Hq, D], k [n, Hkv, D] -> rotated (q, k)."""
        ...

    def store_kv(self, kv_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [n, Hkv, D] at cache ``slots`` of one layer's [2, pages, page_size, Hkv, D]."""
        ...


# -- the reference -------------------------------------------------------------------------
def rms_scale_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., 1] fp32: 1 / rms of each row, the factor RMSNorm applies before its weight."""
    h = x.float()
    return torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x.float() * rms_scale_ref(x, eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(inv_freq: torch.Tensor, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _add_rms_norm_ref(x, residual, weight, eps: float):
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def _silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _store_kv_ref(kv_layer, slots, k, v) -> None:
    h, d = k.shape[1], k.shape[2]
    kv_layer[0].view(-1, h, d).index_copy_(0, slots, k.to(kv_layer.dtype))
    kv_layer[1].view(-1, h, d).index_copy_(0, slots, v.to(kv_layer.dtype))


class TorchOps:
    name = "torch"
    in_place = False
    position_table = False

    def rms_norm(self, x, weight, eps):
        return rms_norm_ref(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return _add_rms_norm_ref(x, residual, weight, eps)

    def silu_and_mul(self, x):
        return _silu_and_mul_ref(x)

    def rope(self, rope, q, k, positions):
        return rope_ref(rope.inv_freq, q, k, positions)

    def store_kv(self, kv_layer, slots, k, v):
        _store_kv_ref(kv_layer, slots, k, v)


TORCH_OPS = TorchOps()


# -- fused CUDA kernels --------------------------------------------------------------------
def _kv_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """[2, n, Hkv, D] view over k and v when v directly follows k in each row (they are
    slices of one fused qkv output), else None."""
    n, h, d = k.shape
    if (v.shape != k.shape or v.stride() != k.stride() or k.stride()[1:] != (d, 1)
            or v.data_ptr() != k.data_ptr() + h * d * k.element_size()):
        return None
    return k.as_strided((2, n, h, d), (h * d, k.stride(0), d, 1))


def _store_kv_fused(kv_layer, slots, k, v) -> None:
    """One scatter for K and V (the reference issues two; index_copy_ beat index_put_ by ~0.4 µs
    a layer on an H100, see bench/results/engines)."""
    pair = _kv_pair(k, v)
    if pair is None or k.dtype != kv_layer.dtype:
        _store_kv_ref(kv_layer, slots, k, v)
        return
    kv_layer.view(2, -1, k.shape[1], k.shape[2]).index_copy_(1, slots, pair)


class FlashInferOps:
    name = "flashinfer"
    in_place = True
    position_table = True

    def __init__(self):
        from mstar.services.engines.attn_flashinfer import _import_flashinfer

        self._fi = _import_flashinfer()

    def rms_norm(self, x, weight, eps):
        return self._fi.rmsnorm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        self._fi.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def silu_and_mul(self, x):
        return self._fi.silu_and_mul(x)

    def rope(self, rope, q, k, positions):
        self._fi.apply_rope_with_cos_sin_cache_inplace(
            positions, q, k, q.shape[-1], rope.cos_sin_cache(q.device), is_neox=True)
        return q, k

    def store_kv(self, kv_layer, slots, k, v):
        _store_kv_fused(kv_layer, slots, k, v)


def fused_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda":
        return f"device is {device}, not CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype is {dtype}; the fused kernels take float16 / bfloat16"
    return None


def make_ops(kind: str, device: torch.device | str, dtype: torch.dtype) -> Ops:
    """'torch', 'flashinfer', or 'auto' (FlashInfer where it applies and is
    importable, else torch)."""
    if kind not in KNOWN:
        raise ValueError(f"Unknown kernels '{kind}'. Known: {', '.join(KNOWN)}")
    device = torch.device(device)
    why_not = fused_unavailable_reason(device, dtype)
    if kind == "torch" or (kind == "auto" and why_not):
        return TORCH_OPS
    if why_not:
        raise ValueError(f"kernels='{kind}' unavailable: {why_not}")
    if kind == "auto" and importlib.util.find_spec("flashinfer") is None:
        return TORCH_OPS
    return FlashInferOps()
