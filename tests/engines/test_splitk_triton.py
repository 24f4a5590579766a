"""The split-K skinny GEMM (services/engines/splitk_triton.py) against torch: on a CPU through Triton's
interpreter in fp32 (atol 1e-4); on a GPU in bf16 (no further from fp32 than cuBLAS' bf16 GEMM, x2)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels in numpy
pytest.importorskip("triton", reason="the split-K GEMM needs the triton package")

from mstar.services.engines import splitk_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
SMALL = (16, 16, 16, 2, 4)  # BM, BLOCK_N, BLOCK_K, stages, warps: several tiles and splits at test sizes


def _close(got, want, ref):
    if DTYPE == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        assert (got.float() - ref).abs().max() <= 2 * (want.float() - ref).abs().max() + 1e-2


@pytest.mark.parametrize("m,n,k,splits", [(20, 40, 64, 1), (20, 40, 64, 3), (37, 24, 100, 4), (5, 16, 48, 8)])
def test_plain(m, n, k, splits):
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    got = splitk_triton.linear(x.to(DEVICE, DTYPE), w.to(DEVICE, DTYPE), config=SMALL, splits=splits)
    want = torch.nn.functional.linear(x.to(DEVICE, DTYPE), w.to(DEVICE, DTYPE))
    _close(got, want, (x @ w.T).to(DEVICE))


def test_gated_residual_and_repeated_launches():
    """res + (x @ w.T) * gate with one gate row per 10 rows (per sequence), three launches in a row:
    each leaves its tile counters at zero for the next."""
    g = torch.Generator().manual_seed(1)
    m, n, k = 30, 40, 80
    x, w, res, gate = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (m, n), (3, n)))
    ref = res + (x @ w.T) * gate.repeat_interleave(10, 0)
    dev = [t.to(DEVICE, DTYPE) for t in (x, w, res, gate)]
    want = dev[2] + torch.nn.functional.linear(dev[0], dev[1]) * dev[3].repeat_interleave(10, 0)
    for _ in range(3):
        _close(splitk_triton.linear(*dev, rows_per_gate=10, config=SMALL, splits=3), want, ref.to(DEVICE))


def test_bad_operands_are_named():
    x, w = torch.randn(4, 8), torch.randn(6, 9)
    with pytest.raises(ValueError, match="x \\[M, K\\] @ w"):
        splitk_triton.linear(x, w)
    with pytest.raises(ValueError, match="res \\[M, N\\]"):
        splitk_triton.linear(x, torch.randn(6, 8), torch.randn(4, 5), torch.randn(4, 6))
