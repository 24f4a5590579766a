"""Programmatic dependent launch (PDL) for the Triton kernels of the decode graphs.

A kernel launched as a programmatic dependent may start before the kernel ahead of it in the
stream has finished. It does whatever reads nothing that kernel writes (page-table metadata, the
RoPE table, each row's 1 / rms of the residual stream, which a kernel two launches back wrote),
then waits (``gdc_wait``) until the kernel ahead has completed and its writes are visible. A
kernel may let its own dependents start early (``gdc_launch_dependents``). At decode sizes each
kernel is short and latency-bound, so its launch and first dependent loads are a large part of it;
PDL overlaps them with the tail of the kernel before.

Needs an sm_90+ GPU and a Triton with grid dependency control; CUDA-graph capture keeps the
programmatic edges. In the fused-norm decode graphs (``DecoderLayer.forward_fused_norms``), up to
``gemm_triton.MAX_ROWS`` rows, a layer runs qkv (Triton) -> attention -> o_proj (Triton) -> gate/up
(cuBLAS) -> SiLU·mul -> down (Triton). Each Triton kernel is a programmatic dependent of the one
ahead and lets its own dependents launch once its main loop is done, always after its own wait, so
a kernel starting early has every kernel two launches back complete. The cuBLAS GEMM is an
ordinary launch (it starts after the kernel ahead ends) and never triggers early, so the SiLU·mul
kernel after it gains only its launch. On an H100 a dependent launched behind a cuBLAS kernel
gained nothing measurable; behind the Triton GEMMs, with them, 1-4% of a step at 1-16 rows
(bench/results/engines/2026-11-25f/).
"""

from __future__ import annotations

import torch

#: ``EngineConfig.pdl``: 'auto' (where ``pdl_unavailable_reason`` is None and the graphs run the
#: fused-norm Triton kernels), 'on' (an error where it cannot), 'off'.
PDL_MODES = ("auto", "on", "off")


def __getattr__(name: str):
    """``gdc_wait`` / ``gdc_launch_dependents`` for the kernel modules (None where this Triton
    lacks them), imported on first use: importing triton here would come before the CPU tests
    switch it to its interpreter (TRITON_INTERPRET), which must be set before triton loads."""
    if name not in ("gdc_wait", "gdc_launch_dependents"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from triton.language.extra import cuda
    except ImportError:  # no triton, or one without grid dependency control: pdl_unavailable_reason says so
        return None
    return getattr(cuda, name, None)


def pdl_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot be launched as programmatic dependents here (None: they can)."""
    if device.type != "cuda":
        return f"device is {device}, not CUDA"
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} < 9.0"
    if __getattr__("gdc_wait") is None:
        return "this Triton has no grid dependency control (triton.language.extra.cuda.gdc_wait)"
    return None


def launch_options(pdl: bool) -> dict:
    """Keyword arguments for a Triton launch: a programmatic dependent launch or an ordinary one
    (nothing passed, so the CPU interpreter sees no option it lacks)."""
    return {"launch_pdl": True} if pdl else {}
