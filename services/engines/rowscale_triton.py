"""SiLU·mul with each row's RMSNorm scale applied on the way, for decode steps that skip the
norm kernels (``ForwardContext.fused_norms``).

With the norm's weight folded into the gate/up projection (``LlamaForCausalLM.fold_norms``),
``gate_up(norm(x))`` equals ``r · gate_up(x)`` row by row, where ``r = 1 / rms(x)``. So the GEMM
reads the residual stream ``x`` itself, and this kernel, which has to touch the GEMM's output
anyway, computes ``r`` from ``x`` (one hidden-size row per program, from L2) and returns
``silu(r·gate) · (r·up)``. On a CPU it runs under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mstar.services.engines.kernels import rms_scale_ref
from mstar.services.engines.pdl import gdc_launch_dependents, gdc_wait, launch_options

#: Output columns per program (programs per row = intermediate size / BLOCK).
BLOCK = 1024


@triton.jit
def _row_rsqrt(src_ptr, row, src_stride, hidden, eps, HIDDEN_P2: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of one row of ``src`` (fp32)."""
    c = tl.arange(0, HIDDEN_P2)
    x = tl.load(src_ptr + row * src_stride + c, mask=c < hidden, other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden + eps)


@triton.jit
def _silu_mul_rowscale_kernel(x_ptr, src_ptr, out_ptr, x_stride, src_stride, out_stride, inter, hidden, eps,
                              BLOCK: tl.constexpr, HIDDEN_P2: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    r = _row_rsqrt(src_ptr, row, src_stride, hidden, eps, HIDDEN_P2)  # src: not written by the GEMM ahead
    if PDL:  # a programmatic dependent of the gate/up GEMM (pdl.py)
        gdc_wait()
        gdc_launch_dependents()  # the down projection may launch now; it waits for this kernel's end
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32) * r
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32) * r
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_rowscale(x: torch.Tensor, src: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """x [n, 2·I] (gate | up of un-normalised rows), src [n, hidden] (those rows) ->
    silu(r·gate) · (r·up) [n, I], r = rsqrt(mean(src²) + eps) per row. ``pdl``: launched as a
    programmatic dependent of the kernel that wrote ``x`` (pdl.py; ``src`` must be older)."""
    n, two_i = x.shape
    if two_i % 2 or src.shape[0] != n or x.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError(f"need x [n, 2I] and src [n, hidden] with dense rows, got {tuple(x.shape)} / {tuple(src.shape)}")
    inter, hidden = two_i // 2, src.shape[1]
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    _silu_mul_rowscale_kernel[(n, triton.cdiv(inter, BLOCK))](
        x, src, out, x.stride(0), src.stride(0), out.stride(0), inter, hidden, eps,
        BLOCK=BLOCK, HIDDEN_P2=triton.next_power_of_2(hidden), PDL=pdl, **launch_options(pdl),
    )
    return out


def silu_mul_rowscale_ref(x: torch.Tensor, src: torch.Tensor, eps: float) -> torch.Tensor:
    r = rms_scale_ref(src, eps)
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(r * gate) * (r * up)).to(x.dtype)
