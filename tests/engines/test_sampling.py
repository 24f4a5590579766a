import math

import pytest
import torch

from mstar.services.engines import Sampler, SamplingParams
from mstar.services.engines.sampling import (
    FinishReason,
    apply_repetition_penalty,
    check_stop,
    filtered_probs,
    row_cumsum,
    seeded_uniform,
    seeded_uniforms,
)

PROBS = [0.5, 0.3, 0.15, 0.05]  # a hand-made distribution
LOGITS = torch.tensor([[math.log(p) for p in PROBS]])


def kept(masked: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > float("-inf")).flatten().tolist() for row in masked]


def kept_tokens(top_k, top_p, min_p, sort=True):
    rows = LOGITS.repeat(len(top_k), 1)
    probs, order = filtered_probs(rows, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p), sort)
    ids = order if order is not None else torch.arange(4).expand(len(top_k), 4)
    return [sorted(i[p > 0].tolist()) for i, p in zip(ids, probs, strict=True)]


def test_top_k_top_p_min_p_masks_on_a_known_distribution():
    assert kept_tokens([1, 2, 0], [1.0] * 3, [0.0] * 3) == [[0], [0, 1], [0, 1, 2, 3]]
    # top_p keeps the smallest prefix reaching the mass: 0.5 | 0.5+0.3 | 0.5+0.3+0.15
    assert kept_tokens([0] * 3, [0.4, 0.7, 0.9], [0.0] * 3) == [[0], [0, 1], [0, 1, 2]]
    # min_p drops p < min_p * 0.5, in sorted order or not
    for sort in (True, False):
        assert kept_tokens([0] * 3, [1.0] * 3, [0.2, 0.4, 0.0], sort) == [[0, 1, 2], [0, 1], [0, 1, 2, 3]]


def test_draws_follow_the_distribution():
    """Inverse-CDF draws from the hand-made distribution: frequencies within 4 sigma."""
    n = 4000
    rows = LOGITS.repeat(n, 1)
    params = [SamplingParams(seed=s) for s in range(n)]
    counts = torch.bincount(Sampler()(rows, params), minlength=4).double() / n
    for got, want in zip(counts.tolist(), PROBS, strict=True):
        assert abs(got - want) <= 4 * math.sqrt(want * (1 - want) / n), (counts, PROBS)
    # top_p = 0.7 leaves {0, 1} renormalised: 0.625 / 0.375
    counts = torch.bincount(Sampler()(rows, [SamplingParams(seed=s, top_p=0.7) for s in range(n)]), minlength=4)
    assert counts[2:].sum() == 0 and abs(counts[0] / n - 0.625) < 0.03


@pytest.mark.parametrize("vocab", [5, 300, 4097, 128256])
def test_blocked_row_cumsum_equals_cumsum(vocab):
    x = torch.rand(3, vocab, generator=torch.Generator().manual_seed(vocab))
    want = x.double().cumsum(-1)
    got = row_cumsum(x, torch.float64)
    assert got.shape == want.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(row_cumsum(x), x.cumsum(-1), rtol=1e-5, atol=1e-3)


def test_draws_over_a_large_vocabulary_land_where_the_cdf_says():
    """Each seeded draw over a 128k vocabulary is the token whose CDF interval holds
    u x total (reference: one float64 cumsum of the same probabilities)."""
    vocab, n = 128256, 8
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(seed=s) for s in range(n)]
    got = Sampler()(logits, params, counters=[5] * n)
    cdf = logits.softmax(-1).double().cumsum(-1)
    u = torch.tensor([seeded_uniform(s, 5) for s in range(n)], dtype=torch.float64)
    want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    assert got.tolist() == want.tolist()


def test_repetition_penalty_follows_hf_convention():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    history = [0, 1, 1]
    seen = torch.zeros(1, 4, dtype=torch.bool)
    seen[0, history] = True
    ours = apply_repetition_penalty(logits.clone(), seen, [2.0])
    assert ours.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # positive divided, negative multiplied
    hf = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([history]), logits.clone())
    torch.testing.assert_close(ours, hf)


def test_sampler_tracks_seen_tokens_on_the_device():
    """The prompt and every sampled token are penalised from the next draw on; a forgotten
    sequence's slot is reused clean."""
    s, p = Sampler(), SamplingParams(temperature=0, repetition_penalty=100.0)
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    s.track("a", [0], vocab=5, device=torch.device("cpu"))
    picks = [int(s(logits, [p], ["a"])[0]) for _ in range(4)]
    assert picks == [1, 2, 3, 4]  # 0 was in the prompt; each pick is then penalised
    s.forget("a")
    s.track("b", [], vocab=5, device=torch.device("cpu"))
    assert int(s(logits, [p], ["b"])[0]) == 0
    assert int(s(logits, [SamplingParams(temperature=0)], ["b"])[0]) == 0  # no penalty: not applied


def test_greedy_is_deterministic_and_picks_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    p = [SamplingParams(temperature=0)] * 4
    a, b = Sampler()(logits, p), Sampler()(logits, p)
    assert a.tolist() == b.tolist() == logits.argmax(-1).tolist()


def _draws(seed, n=12, other_rows=0):
    """n tokens from a flat distribution for one seeded request, batched with unseeded rows."""
    logits = torch.zeros(1 + other_rows, 1000)
    params = [SamplingParams(seed=seed)] + [SamplingParams()] * other_rows
    sampler = Sampler()
    return [int(sampler(logits, params, counters=[i] * (1 + other_rows))[0]) for i in range(n)]


def test_same_seed_same_tokens_different_seed_differs():
    assert _draws(1) == _draws(1)
    assert _draws(1) == _draws(1, other_rows=3)  # independent of what else shares the batch
    assert _draws(1) != _draws(2)
    assert len(set(_draws(1))) > 6  # successive outputs of one seed are not one draw repeated
    u = [seeded_uniform(7, i) for i in range(1000)]
    assert all(0 <= x < 1 for x in u) and abs(sum(u) / len(u) - 0.5) < 0.05


def test_batched_seeded_uniforms_equal_the_scalar_ones_bit_for_bit():
    seeds = [0, 1, 7, 2**31 - 1, 2**63 + 5, 2**64 - 1, 2**70 + 3, -5, 123456789] * 3
    counters = list(range(len(seeds) - 3)) + [2**40, 2**64 + 1, 10**6]
    got = seeded_uniforms(seeds, counters).tolist()
    assert got == [seeded_uniform(s, c) for s, c in zip(seeds, counters, strict=True)]
    # a batch with one unseeded row takes the scalar path: seeded rows draw the same
    params = [SamplingParams(seed=3), SamplingParams(seed=None)]
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    assert int(Sampler()(logits, params, counters=[4, 4])[0]) == int(Sampler()(logits[:1], params[:1], counters=[4])[0])


def test_allowed_ranges_are_respected():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(3))
    logits[:, 0] = 50.0  # the unconstrained favourite lies outside the ranges
    ranges = ((10, 20), (90, 95))
    params = [SamplingParams(seed=s, allowed_token_ranges=ranges) for s in (1, 2)]
    seen = {int(t) for i in range(100) for t in Sampler()(logits, params, counters=[i, i])}
    assert len(seen) > 5 and all(10 <= t < 20 or 90 <= t < 95 for t in seen)
    # the compacted path (allowed sets far smaller than the vocabulary) gives the same tokens
    # as the masked full-vocabulary path
    wide = ((0, 60),)
    mixed = [SamplingParams(seed=1, allowed_token_ranges=ranges), SamplingParams(seed=2, allowed_token_ranges=wide)]
    narrow = [SamplingParams(seed=1, allowed_token_ranges=ranges), SamplingParams(seed=2, allowed_token_ranges=((0, 40),))]
    for i in range(20):
        a = Sampler()(logits, mixed, counters=[i, i])  # a set over half the vocab: no compaction
        b = Sampler()(logits, narrow, counters=[i, i])  # compacted
        assert int(a[0]) == int(b[0])
    greedy = Sampler()(logits, [SamplingParams(temperature=0, allowed_token_ranges=ranges)] * 2)
    inside = torch.cat([torch.arange(10, 20), torch.arange(90, 95)])
    assert greedy.tolist() == inside[logits[:, inside].argmax(-1)].tolist()


def test_rows_with_different_params_in_one_batch():
    logits = LOGITS.repeat(3, 1)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, seed=0), SamplingParams(top_p=0.7, seed=0)]
    for i in range(20):
        t = Sampler()(logits, params, counters=[i] * 3).tolist()
        assert t[0] == 0 and t[1] == 0 and t[2] in (0, 1)


def test_stop_and_max_tokens():
    p = SamplingParams(stop_token_ids=(7,), max_tokens=3)
    assert check_stop(p, 7, 1) is FinishReason.STOP
    assert check_stop(p, 5, 2) is None
    assert check_stop(p, 5, 3) is FinishReason.LENGTH


@pytest.mark.parametrize("kw", [dict(top_p=0.0), dict(temperature=-1), dict(allowed_token_ranges=((5, 5),)),
                                dict(max_tokens=0)])
def test_bad_params_say_what_is_wrong(kw):
    with pytest.raises(ValueError, match=f"SamplingParams.{next(iter(kw))}"):
        SamplingParams(**kw)


def test_allowed_token_cycle_follows_the_output_position():
    from mstar.services.engines.sampling import SamplingParams
    p = SamplingParams(allowed_token_cycle=(((0, 2),), ((5, 7), (9, 10))))
    assert p.at_output(0).allowed_token_ranges == ((0, 2),)
    assert p.at_output(3).allowed_token_ranges == ((5, 7), (9, 10))
    assert p.at_output(3).allowed_token_cycle == ()
    assert SamplingParams().at_output(5) == SamplingParams()


def test_a_seeded_row_draws_the_same_whatever_filters_its_neighbours_use():
    """The draw runs in vocabulary order over the kept tokens, so a row without top-k / top-p
    draws the same token whether or not the batch sorts for another row's top-p (it used to
    draw in sorted order then), and a top-p row that keeps everything draws as plain sampling."""
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(2)) * 2
    plain = SamplingParams(seed=9)
    for i in range(30):
        alone = int(Sampler()(logits, [plain], counters=[i])[0])
        beside = Sampler()(logits.repeat(3, 1), [plain, SamplingParams(seed=1, top_p=0.5),
                                                 SamplingParams(seed=9, top_p=1.0, top_k=500)], counters=[i] * 3)
        assert int(beside[0]) == alone and int(beside[2]) == alone


def test_plan_then_sample_equals_one_call_and_refuses_other_logits():
    """The engine plans a batch before its forward pass (the per-row numbers go up meanwhile)
    and samples once the logits exist: same tokens as one call; logits or numbers of another
    shape than planned are refused, not sampled."""
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.8, seed=s, top_k=5 * (s % 2), allowed_token_ranges=((0, 30),) * (s > 1))
              for s in range(4)]
    sampler = Sampler()
    plan = sampler.plan(params, 40, logits.device, counters=[7] * 4)
    got = sampler.sample(logits, plan, torch.from_numpy(plan.host))
    assert got.tolist() == Sampler()(logits, params, counters=[7] * 4).tolist()
    with pytest.raises(ValueError, match="do not match the plan"):
        sampler.sample(logits[:, :39], plan, torch.from_numpy(plan.host))
    with pytest.raises(ValueError, match="do not match the plan"):
        sampler.sample(logits[:3], plan, torch.from_numpy(plan.host))
