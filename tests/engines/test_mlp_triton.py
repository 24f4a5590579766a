"""The fused SiLU·mul + down projection kernel (mlp_triton.py) against the torch reference: on
a CPU through Triton's interpreter in fp32 (max abs error 1e-4 on O(1) outputs), on a GPU in
bf16 at the Llama-3.2-3B shape, replayed from a CUDA graph (relative error 1e-2)."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels in numpy
pytest.importorskip("triton", reason="the fused MLP kernel needs the triton package (pip install triton)")

from mstar.services.engines import EngineConfig  # noqa: E402
from mstar.services.engines.kernels import TORCH_OPS, WithMlpDown, with_mlp_down  # noqa: E402
from mstar.services.engines.layers import GatedMLP  # noqa: E402
from mstar.services.engines.mlp_triton import MAX_ROWS, SiluMulDown  # noqa: E402

#: small tiles so the CPU shapes take several output tiles and K slices
SMALL = {16: (32, 32, 3, 4, 2), 32: (32, 32, 1, 4, 2), 64: (16, 64, 4, 4, 2)}


def _reference(gate_up, w, b):
    i = w.shape[1]
    return F.linear(F.silu(gate_up[:, :i]) * gate_up[:, i:], w, b)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64])
@pytest.mark.parametrize("layout", ["row_major", "column_major"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_tail_matches_the_reference(rows, layout, bias):
    g = torch.Generator().manual_seed(rows)
    n, i = 70, 100  # neither a multiple of the tiles: masked edges in N and K
    gate_up = torch.randn(rows, 2 * i, generator=g)
    w = torch.randn(n, i, generator=g) / i**0.5
    if layout == "column_major":  # as set_weight_layout stores projections on CUDA
        w = w.t().contiguous().t()
    b = torch.randn(n, generator=g) if bias else None
    fused = SiluMulDown(SMALL)
    want = _reference(gate_up, w, b)
    for _ in range(3):  # repeated launches: the split-K counters reset themselves
        got = fused(gate_up, w, b)
        assert got.shape == (rows, n) and got.dtype == gate_up.dtype
        assert (got - want).abs().max().item() < 1e-4


def test_gate_up_rows_may_be_strided():
    g = torch.Generator().manual_seed(0)
    n, i = 40, 64
    wide = torch.randn(4, 2 * i + 8, generator=g)
    gate_up = wide[:, : 2 * i]  # a view with a longer row stride
    w = torch.randn(n, i, generator=g) / 8
    assert (SiluMulDown(SMALL)(gate_up, w, None) - _reference(gate_up, w, None)).abs().max().item() < 1e-4


def test_shapes_are_checked():
    fused = SiluMulDown(SMALL)
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"gate_up must be \[M, 32\] with dense columns for a \[8, 16\] down weight"):
        fused(torch.randn(2, 30), w, None)
    with pytest.raises(ValueError, match=f"65 rows: the fused SiLU·mul \\+ down kernel takes 1..{MAX_ROWS}"):
        fused(torch.randn(65, 32), w, None)
    assert fused.applies(MAX_ROWS) and not fused.applies(MAX_ROWS + 1) and not fused.applies(0)


class Counting(SiluMulDown):
    calls = 0

    def __call__(self, *a):
        Counting.calls += 1
        return super().__call__(*a)


@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_takes_the_fused_tail_at_decode_sizes_only(bias):
    torch.manual_seed(1)
    mlp = GatedMLP(48, 80, bias=bias).eval()
    ops = WithMlpDown(TORCH_OPS, Counting(SMALL))
    assert ops.name == "torch" and ops.rms_norm is not None  # the rest is the base's
    with torch.no_grad():
        for rows, fused_calls in ((3, 1), (MAX_ROWS, 1), (MAX_ROWS + 6, 0)):
            before = Counting.calls
            x = torch.randn(rows, 48)
            got, want = mlp(x, ops), mlp(x)
            assert Counting.calls - before == fused_calls
            assert (got - want).abs().max().item() < 1e-4


def test_the_setting_is_validated_and_says_why_it_cannot_run():
    with pytest.raises(ValueError, match="EngineConfig.fused_mlp: 'maybe' is not one of auto, on, off"):
        EngineConfig(fused_mlp="maybe")
    with pytest.raises(ValueError, match="EngineConfig.fused_mlp: 'yes' is not one of auto, on, off"):
        with_mlp_down(TORCH_OPS, "yes", "cpu", torch.float32)
    assert with_mlp_down(TORCH_OPS, "off", "cpu", torch.float32) is TORCH_OPS
    assert with_mlp_down(TORCH_OPS, "auto", "cpu", torch.float32) is TORCH_OPS  # not CUDA: the unfused path
    with pytest.raises(ValueError, match="fused_mlp='on' unavailable: device is cpu, not CUDA"):
        with_mlp_down(TORCH_OPS, "on", "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 8, 16, 33, 64])
def test_gpu_bf16_in_a_cuda_graph_at_the_3b_shape(rows):
    from mstar.services.engines.mlp_triton import CONFIGS

    torch.manual_seed(rows)
    n, i, dev = 3072, 8192, "cuda"
    gate_up = torch.randn(rows, 2 * i, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(n, i, device=dev, dtype=torch.bfloat16) / i**0.5).t().contiguous().t()
    fused = SiluMulDown(CONFIGS)
    fused(gate_up, w, None)  # buffers before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(gate_up, w, None)
    want = _reference(gate_up.float(), w.float(), None)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert ((out.float() - want).norm() / want.norm()).item() < 1e-2
