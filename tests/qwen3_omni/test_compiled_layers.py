"""The Thinker's and the Talker's decoder layers as served on a GPU (``compile_layers``): the work
around their GEMMs and attention in three torch.compile'd pieces. Here dynamo runs them with the
eager backend (the same ops), in bfloat16 on a CPU (torch._grouped_mm traces only in bfloat16):
the engine's greedy tokens and the logits equal the eager layers', each piece is compiled once for
every layer (not once a layer), ``warm_compiled`` leaves nothing to compile once the engine runs
(torch.compile is not thread-safe: the engines' threads must never compile), and an
expert-parallel rank's share maps the other ranks' experts out as the eager path does. What inductor makes of the pieces is measured on a GPU
(``bench/qwen3_omni/decode_step.py --compiled``)."""

import copy

import pytest
import torch
from test_thinker_tp import run_engine, text_logits
from torch._dynamo.testing import CompileCounter

from mstar.models.qwen3_omni import layers
from mstar.models.qwen3_omni.cache import NoCache
from mstar.models.qwen3_omni.layers import compile_layers, grouped_mm_ok, warm_compiled
from mstar.models.qwen3_omni.predictor_loop import warm_predictor
from mstar.models.qwen3_omni.thinker_engine import ThinkerEngine
from mstar.models.qwen3_omni.thinker_tp import ExpertParallelMoe


@pytest.fixture(scope="module")
def bf16(parts):
    """The tiny parts' Thinker and Talker in bfloat16 (copies: the session's stay fp32)."""
    down = parts.thinker.model.layers[0].mlp.experts.down
    if not grouped_mm_ok(*down.shape[1:], dtype=torch.bfloat16):
        pytest.skip("this torch has no torch._grouped_mm (the compiled layers' MoE path)")
    return copy.deepcopy(parts.thinker).to(torch.bfloat16), copy.deepcopy(parts.talker).to(torch.bfloat16)


def _both(fn, decoder, counter):
    with torch.inference_mode():
        want = fn()
        try:
            compile_layers(decoder, counter)
            got = fn()
        finally:
            compile_layers(decoder, None)
    return want, got


def test_thinker_engine_and_logits_as_eager(parts, bf16):
    counter = CompileCounter()
    cfg, thinker = parts.cfg, bf16[0]

    def run():
        engine = ThinkerEngine(thinker, cfg.accept_hidden_layer, 4, 64)
        return text_logits(thinker, cfg), run_engine(engine, cfg)
    (logits, res), (logits_c, res_c) = _both(run, thinker.model, counter)
    torch.testing.assert_close(logits_c, logits, atol=1e-5, rtol=0)
    assert res_c["tokens"] == res["tokens"]
    for rid, rows in res["talker_rows"].items():
        torch.testing.assert_close(res_c["talker_rows"][rid], rows, atol=1e-5, rtol=0)
    # three pieces, each at most twice (prefill lengths; single-row steps): not per layer (3 here)
    assert 3 <= counter.frame_count <= 6


class KernelsStandIn(layers.GroupedGemms):
    """What the compiled MoE piece meets on a GPU as ``layers.MOE_KERNELS``: the Triton kernels' rule
    on the batch's size (here at 12 pairs, 6 rows of this model's top-2, so that the prompts are
    past it and the decode steps within it), and their two projections, here the grouped GEMMs."""

    MAX_PAIRS = 12

    @classmethod
    def fits(cls, x, pairs, gate_up):
        return pairs <= cls.MAX_PAIRS


@pytest.mark.parametrize("kernels", [None, KernelsStandIn], ids=["grouped-gemms", "size-ruled-kernels"])
def test_warmed_layers_compile_nothing_while_the_engine_runs(parts, bf16, kernels, monkeypatch):
    """After ``warm_compiled`` (as the nodes run it at start) a whole engine run, prompts of
    several lengths and decode steps of 1 to 4 rows, compiles no piece again; also where the MoE
    piece branches on the batch's size (the GPU's decode kernels): both sides were warmed."""
    cfg, thinker = parts.cfg, bf16[0]
    monkeypatch.setattr(layers, "MOE_KERNELS", kernels)
    counter = CompileCounter()
    try:
        compile_layers(thinker.model, counter)
        warm_compiled(lambda e, pos: thinker(e, pos, NoCache()), cfg.text.hidden_size, torch.bfloat16, "cpu")
        warmed = counter.frame_count
        assert warmed >= 3
        with torch.inference_mode():
            run_engine(ThinkerEngine(thinker, cfg.accept_hidden_layer, 4, 64), cfg)
            text_logits(thinker, cfg)
        assert counter.frame_count == warmed
    finally:
        compile_layers(thinker.model, None)


def test_talker_with_its_shared_expert_as_eager(parts, bf16):
    talker = bf16[1]
    x = torch.randn(9, parts.cfg.talker.hidden_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    pos = torch.arange(9).expand(3, -1)
    counter = CompileCounter()
    want, got = _both(lambda: talker(x, pos, NoCache()), talker.model, counter)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert counter.frame_count >= 3  # the compiled pieces ran (attention in, add + norm, the MoE)


def test_code_predictor_frame_as_eager_and_warmed(parts, bf16):
    """The code predictor's frame loop with its layers under ``compile_layers`` (as the Talker's
    node runs it on a GPU): the same codes and embedding sum as the eager loop for greedy and
    seeded sampled rows; three pieces, each compiled for one row and for more (not per layer or
    per codebook); and after ``warm_predictor`` a frame of any batch compiles nothing."""
    cp = bf16[1].code_predictor
    g = torch.Generator().manual_seed(21)
    h = parts.cfg.talker.hidden_size
    hidden, e0 = (torch.randn(3, h, generator=g).to(torch.bfloat16) for _ in range(2))

    def frame(rows=3):  # fresh inputs made in inference mode, as the Talker's engine makes them
        gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)][:rows]
        with torch.inference_mode():
            return cp.predict(hidden[:rows].clone(), e0[:rows].clone(), torch.tensor([True, False, False][:rows]), gens)
    counter = CompileCounter()
    want, got = _both(frame, cp.model, counter)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    assert 3 <= counter.frame_count <= 6
    counter = CompileCounter()
    try:
        compile_layers(cp.model, counter)
        warm_predictor(cp, torch.bfloat16, "cpu", max_rows=4)
        warmed = counter.frame_count
        assert warmed >= 3
        for rows in (1, 2, 3):
            frame(rows)
        assert counter.frame_count == warmed
    finally:
        compile_layers(cp.model, None)


class _OneRank:
    size = 1

    @staticmethod
    def all_reduce(x):
        return x


@pytest.mark.parametrize("first", [0, 2])
def test_an_expert_parallel_share_maps_the_other_ranks_out(parts, bf16, first):
    """A rank holding experts [first, first + 2) of 4: its compiled share equals its eager one
    (other ranks' experts weigh 0 in both)."""
    full = parts.thinker.model.layers[0].mlp
    cfg = parts.cfg.text
    moe = ExpertParallelMoe(cfg, range(first, first + 2), _OneRank())
    moe.gate.weight.data.copy_(full.gate.weight)
    moe.experts.gate_up.data.copy_(full.experts.gate_up[first:first + 2])
    moe.experts.down.data.copy_(full.experts.down[first:first + 2])
    moe = moe.to(torch.bfloat16)
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(moe.fused(x, CompileCounter()), moe(x), atol=1e-6, rtol=0)


def test_compiled_layers_are_refused_without_grouped_mm(parts, bf16, monkeypatch):
    """Their MoE is the grouped-GEMM path only: where torch._grouped_mm does not serve the experts'
    dtype and device, compile_layers refuses instead of compiling a path that cannot run."""
    import mstar.models.qwen3_omni.layers as layers

    monkeypatch.setattr(layers, "grouped_mm_ok", lambda *a, **k: False)
    with pytest.raises(ValueError, match="need torch._grouped_mm for torch.bfloat16 experts on cpu"):
        compile_layers(bf16[0].model, CompileCounter())
    assert all(getattr(m, "compiled", None) is None for m in bf16[0].model.layers)
