"""The routed experts' Triton decode kernels (services/engines/moe_triton.py) inside
``grouped_experts`` against the per-expert loop (``Experts._loop``): on a CPU through Triton's
interpreter in fp32 (atol 1e-5), on a GPU in bf16 against the grouped GEMMs (relative error 1e-2)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels in numpy
pytest.importorskip("triton", reason="the MoE kernels need the triton package (pip install triton)")

from mstar.models.qwen3_omni.layers import Experts, grouped_experts  # noqa: E402
from mstar.services.engines import moe_triton  # noqa: E402


def _case(experts: int, hidden: int, inner: int, tokens: int, k: int, device, dtype, other_rank: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = Experts(experts, hidden, inner)
    with torch.no_grad():
        ex.gate_up.copy_(torch.randn(ex.gate_up.shape, generator=g) * hidden ** -0.5)
        ex.down.copy_(torch.randn(ex.down.shape, generator=g) * inner ** -0.5)
    ex = ex.to(device, dtype)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    # distinct experts per token; with other_rank, index == experts marks another rank's expert
    index = torch.stack([torch.randperm(experts + other_rank, generator=g)[:k] for _ in range(tokens)]).to(device)
    weight = torch.rand(tokens, k, generator=g).to(device, dtype)
    return ex, x, index, weight


@pytest.mark.parametrize("tokens,k,other_rank", [(5, 2, False), (3, 3, True), (40, 2, False)],
                         ids=["few", "other-rank", "past-a-row-block"])  # 40 x 2 over 6 experts: > 16 rows an expert
def test_triton_experts_equal_the_per_expert_loop(tokens, k, other_rank):
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; the GPU test below covers CUDA")
    ex, x, index, weight = _case(6, 64, 32, tokens, k, "cpu", torch.float32, other_rank)
    assert moe_triton.fits(x, tokens * k, ex.gate_up)
    with torch.no_grad():
        want = ex._loop(x, index, weight)
        got = grouped_experts(x, index, weight, ex.gate_up, ex.down, kernels=moe_triton)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_what_the_kernels_take():
    x = torch.zeros(4, 64)
    assert moe_triton.fits(x, 4 * 8, torch.zeros(8, 64, 64))
    assert not moe_triton.fits(x, moe_triton.MAX_PAIRS + 1, torch.zeros(8, 64, 64))  # a prefill: grouped GEMMs
    assert not moe_triton.fits(x, 8, torch.zeros(8, 2 * 24, 64))  # 24 inner columns: 8-wide tiles
    assert not moe_triton.fits(x.long(), 8, torch.zeros(8, 64, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_triton_experts_on_gpu_equal_the_grouped_gemms_in_bf16(tokens):
    """The Thinker's expert shapes (128 experts, hidden 2048, inner 768, top-8), bf16."""
    from mstar.models.qwen3_omni.layers import MOE_KERNELS
    assert MOE_KERNELS is moe_triton
    ex, x, index, weight = _case(128, 2048, 768, tokens, 8, "cuda", torch.bfloat16, False)
    with torch.no_grad():
        got = grouped_experts(x, index, weight, ex.gate_up, ex.down)  # auto: the kernels on CUDA
        loop = ex._loop(x, index, weight)  # the naive per-expert path
    err = (got.float() - loop.float()).abs().max() / loop.float().abs().max()
    assert err < 1e-2, err
