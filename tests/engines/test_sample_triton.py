"""The fused Triton sampler (sample_triton.py) against the torch sampler: same tokens and same
seen-ids marks for the same seeded uniforms, on a CPU through Triton's interpreter and on a GPU
(float32 logits, no exact ties: among tied probabilities the two keep different members at the
top-p edge, tested on its own)."""

import math
import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels in numpy
pytest.importorskip("triton", reason="the fused sampler needs the triton package (pip install triton)")

from mstar.services.engines.sample_triton import sample_compact  # noqa: E402
from mstar.services.engines.sampling import FUSED_MAX_WIDTH, Sampler, SamplingParams  # noqa: E402

V = 700
EOS = 699
CYCLE = (((100, 356), (EOS, EOS + 1)), ((356, 612), (EOS, EOS + 1)))  # two code positions + end token
PARAMS = [
    SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, seed=1, allowed_token_cycle=CYCLE),  # Orpheus'
    SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, seed=2, allowed_token_cycle=CYCLE),
    SamplingParams(temperature=0.0, allowed_token_cycle=CYCLE),  # greedy
    SamplingParams(temperature=1.0, top_k=5, seed=3, allowed_token_cycle=CYCLE),
    SamplingParams(temperature=0.9, top_p=0.95, min_p=0.1, seed=4, allowed_token_cycle=CYCLE),
    SamplingParams(temperature=1.3, allowed_token_cycle=CYCLE),  # unseeded: the sampler's own stream
    SamplingParams(temperature=0.7, top_k=3, top_p=0.5, repetition_penalty=2.0, seed=5, allowed_token_cycle=CYCLE),
]


def _steps(fused: bool, logits: torch.Tensor, columns: torch.Tensor | None, track=(0, 1, 2, 6)):
    """Each step's tokens and the seen mask after the last, rows tracked per ``track``."""
    s = Sampler(seed=7, fused=fused)
    keys = [f"r{i}" if i in track else None for i in range(len(PARAMS))]
    for k in keys:
        if k is not None:
            s.track(k, [101, 102, 357, EOS], V, logits.device)
    out = []
    for t in range(logits.shape[0]):
        x = logits[t] if columns is None else logits[t][:, columns]
        out.append(s(x, [p.at_output(t) for p in PARAMS], keys, [t] * len(PARAMS), columns=columns).cpu())
    return torch.stack(out), s._seen.cpu()


def _logits(device, steps=3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps, len(PARAMS), V, generator=g) * 3
    x[:, :, EOS] -= 4  # the end token stays possible but rare
    return x.to(device)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("restricted,steps", [(False, 1), (True, 2)], ids=["full-head", "restricted-head"])
def test_fused_sampler_draws_what_the_torch_sampler_draws(restricted, steps):
    """(Each row is a program of ~60 bisection passes: slow in the interpreter, so few steps.)"""
    dev = _device()
    logits = _logits(dev, steps)
    columns = torch.tensor(sorted(set(range(100, 612)) | {EOS}), device=dev) if restricted else None
    want, want_seen = _steps(False, logits, columns)
    got, got_seen = _steps(True, logits, columns)
    assert torch.equal(got, want), (got, want)
    assert torch.equal(got_seen, want_seen)
    for t, row in enumerate(got.tolist()):  # and every token is allowed at its position
        lo, hi = CYCLE[t % 2][0]
        assert all(lo <= tok < hi or tok == EOS for tok in row)


def test_tied_probabilities_at_the_top_p_edge_are_kept_together():
    """Five tokens tie below two likely ones and top_p 0.8 is reached inside the tie group: the
    sorted path keeps the group's first two in its sort order, the fused kernel all five (its
    choice does not depend on a sort's order among equals), and draws that land in the group
    spread over its members. One row per seed."""
    n = 32
    logits = torch.zeros(n, 16, device=_device())
    logits[:, 3], logits[:, 5] = 2.0, 1.8  # p 0.40, 0.33, then 0.054 x 5 (tokens 2, 4, 6, 7, 8)
    params = [SamplingParams(top_p=0.8, seed=s, allowed_token_ranges=((2, 9),)) for s in range(n)]
    picks = Sampler(fused=True)(logits, params).tolist()
    assert set(picks) <= set(range(2, 9)) and {3, 5} <= set(picks)
    assert len(set(picks) - {3, 5}) >= 3, picks  # ~9 of 32 draws land in the group of five


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="256 rows take minutes in Triton's interpreter; on a CPU "
                    "the parity tests tie the kernel to the torch sampler, whose distribution test_sampling checks")
def test_fused_draws_follow_the_nucleus_distribution():
    """p = 0.5 / 0.3 / 0.15 / 0.05 with top_p 0.7 keeps {0, 1}: 0.625 / 0.375 (within 4 sigma)."""
    n = 256
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.3, 0.15, 0.05)] + [0.0] * 4], device=_device()).repeat(n, 1)
    params = [SamplingParams(top_p=0.7, seed=s, allowed_token_ranges=((0, 4),)) for s in range(n)]
    counts = torch.bincount(Sampler(fused=True)(logits, params).cpu(), minlength=8)
    assert counts[2:].sum() == 0
    assert abs(counts[0].item() / n - 0.625) <= 4 * math.sqrt(0.625 * 0.375 / n), counts


def test_a_set_wider_than_the_kernel_takes_is_refused():
    ids = torch.arange(FUSED_MAX_WIDTH + 1)[None]
    with pytest.raises(ValueError, match="exceed the fused sampler's 8192"):
        sample_compact(torch.zeros(1, FUSED_MAX_WIDTH + 1), ids, None, torch.zeros(9, 1, dtype=torch.float64), None)
    with pytest.raises(ValueError, match=r"cols \(1, 3\) must match ids \(1, 4\)"):
        sample_compact(torch.zeros(1, 8), torch.arange(4)[None], torch.arange(3)[None],
                       torch.zeros(9, 1, dtype=torch.float64), None)


def test_engine_config_names_a_bad_fused_sampler_setting():
    from mstar.services.engines.kv_engine import EngineConfig

    with pytest.raises(ValueError, match="EngineConfig.fused_sampler: 'maybe' is not one of auto, on, off"):
        EngineConfig(fused_sampler="maybe")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_orpheus_sized_rows_on_the_gpu():
    """16 rows of bf16 logits over Orpheus' restricted head (28,673 columns), 4,097-wide sets:
    every token allowed, seen marks set, and float32 logits give the torch sampler's tokens."""
    from mstar.models.orpheus.llm_node import CODE_CYCLE, union_ranges

    cols = torch.cat([torch.arange(a, b) for a, b in union_ranges(CODE_CYCLE)]).cuda()
    vocab = int(cols[-1]) + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, seed=i, allowed_token_cycle=CODE_CYCLE)
              for i in range(16)]
    for dtype in (torch.float32, torch.bfloat16):
        xs = [(torch.randn(16, len(cols), generator=g, device="cuda") * 4).to(dtype) for _ in range(7)]
        results = []
        for fused in (False, True):
            s = Sampler(fused=fused)
            keys = [f"k{i}" for i in range(16)]
            for k in keys:
                s.track(k, [1, 2, 3], vocab, torch.device("cuda"))
            toks = [s(x, [p.at_output(t) for p in params], keys, [t] * 16, columns=cols) for t, x in enumerate(xs)]
            results.append((torch.stack(toks).cpu(), s._seen.cpu()))
        for t, row in enumerate(results[1][0].tolist()):
            (lo, hi), (eos, _) = CODE_CYCLE[t]
            assert all(lo <= tok < hi or tok == eos for tok in row)
        assert all(results[1][1][s_row, tok] for s_row, toks in enumerate(results[1][0].T.tolist(), start=2)
                   for tok in toks)  # rows tracked in order take slots 2.. (0: never seen, 1: scratch)
        if dtype == torch.float32:
            assert torch.equal(results[0][0], results[1][0])
            assert torch.equal(results[0][1], results[1][1])


FULL_PARAMS = [
    SamplingParams(temperature=1.0, seed=11),  # plain sampling
    SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=12),
    SamplingParams(temperature=0.0),  # greedy
    SamplingParams(temperature=1.2, min_p=0.05, seed=13),
    SamplingParams(temperature=0.9, min_p=0.2, repetition_penalty=1.5, seed=14),
    SamplingParams(temperature=1.0),  # unseeded: the sampler's own stream
    SamplingParams(temperature=0.0, repetition_penalty=2.0),  # greedy after the penalty
]


@pytest.mark.parametrize("block", [256, 4096], ids=["13-blocks", "1-block"])
def test_full_vocabulary_kernels_draw_what_the_torch_sampler_draws(block, monkeypatch):
    """No allowed sets, no top-k / top-p: the two-launch full-vocabulary path against the torch
    sampler over a 3,200-id vocabulary (13 blocks of 256 with a partial last one, or one
    block), three steps, seen marks included."""
    import mstar.services.engines.sample_triton as st

    monkeypatch.setattr(st, "FULL_BLOCK", block)
    vocab, dev = 3200, _device()
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, len(FULL_PARAMS), vocab, generator=g) * 4).to(dev)
    logits[:, :, 3190:] += 6  # likely tokens in the partial last block too
    results = []
    for fused in (False, True):
        s = Sampler(seed=7, fused=fused)
        keys = [f"r{i}" if i in (1, 4, 6) else None for i in range(len(FULL_PARAMS))]
        for k in keys:
            if k is not None:
                s.track(k, [5, 3195, 3199], vocab, logits.device)
        toks = [s(logits[t], FULL_PARAMS, keys, [t] * len(FULL_PARAMS)).cpu() for t in range(3)]
        results.append((torch.stack(toks), s._seen.cpu()))
    (want, want_seen), (got, got_seen) = results
    assert torch.equal(got, want), (got, want)
    assert torch.equal(got_seen, want_seen)
    assert got[:, 2].tolist() == logits[:, 2].argmax(-1).tolist()


def test_full_vocabulary_kernels_are_not_used_for_top_k_top_p_or_allowed_sets(monkeypatch):
    """Rows with top-k / top-p or allowed ranges go to the other paths; the full kernels take
    a batch only when every row fits them."""
    import mstar.services.engines.sample_triton as st

    calls = []
    real = st.sample_full
    monkeypatch.setattr(st, "sample_full", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(0)).to(_device())
    s = Sampler(fused=True)
    s(logits, [SamplingParams(seed=1), SamplingParams(seed=2, top_p=0.9)])
    s(logits, [SamplingParams(seed=1), SamplingParams(seed=2, allowed_token_ranges=((0, 10),))])
    assert calls == []
    s(logits, [SamplingParams(seed=1), SamplingParams(seed=2, min_p=0.1)])
    assert calls == [1]


def test_full_kernel_refuses_a_block_that_is_not_a_power_of_two():
    from mstar.services.engines.sample_triton import sample_full

    with pytest.raises(ValueError, match="block must be a power of two >= 16, got 100"):
        sample_full(torch.zeros(1, 300), torch.zeros(9, 1, dtype=torch.float64), None, block=100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_full_vocabulary_rows_on_the_gpu():
    """16 rows over Llama 3's 128,256 ids: float32 logits give the torch sampler's tokens and
    seen marks (plain, penalised, min-p, greedy rows); bf16 logits stay in the vocabulary and
    greedy rows take the arg-max."""
    vocab = 128256
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [FULL_PARAMS[i % len(FULL_PARAMS)] for i in range(16)]
    params = [p if p.seed is None else replace(p, seed=p.seed + i) for i, p in enumerate(params)]
    for dtype in (torch.float32, torch.bfloat16):
        xs = [(torch.randn(16, vocab, generator=g, device="cuda") * 3).to(dtype) for _ in range(4)]
        results = []
        for fused in (False, True):
            s = Sampler(seed=3, fused=fused)
            keys = [f"k{i}" for i in range(16)]
            for k in keys:
                s.track(k, [1, 2, 3], vocab, torch.device("cuda"))
            toks = [s(x, params, keys, [t] * 16) for t, x in enumerate(xs)]
            results.append((torch.stack(toks).cpu(), s._seen.cpu()))
        got = results[1][0]
        assert bool(((got >= 0) & (got < vocab)).all())
        for i, p in enumerate(params):
            if p.greedy and p.repetition_penalty == 1:
                assert got[:, i].tolist() == [int(x[i].float().argmax()) for x in xs]
        if dtype == torch.float32:
            assert torch.equal(results[0][0], got)
            assert torch.equal(results[0][1], results[1][1])
