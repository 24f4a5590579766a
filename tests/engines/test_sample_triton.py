"""The fused Triton sampler (sample_triton.py) against the torch sampler: same tokens and same
seen-ids marks for the same seeded uniforms, on a CPU through Triton's interpreter and on a GPU
(float32 logits, no exact ties: among tied probabilities the two keep different members at the
top-p edge, tested on its own)."""

import math
import os

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
