import math

import pytest
import torch

from mstar.services.engines import Sampler, SamplingParams
from mstar.services.engines.sampling import (
    FinishReason,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    check_stop,
    make_generator,
)

PROBS = [0.5, 0.3, 0.15, 0.05]  # a hand-made distribution
LOGITS = torch.tensor([[math.log(p) for p in PROBS]])


def kept(masked: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > float("-inf")).flatten().tolist() for row in masked]


def test_top_k_top_p_min_p_masks_on_a_known_distribution():
    rows = LOGITS.repeat(3, 1)
    assert kept(apply_top_k(rows, torch.tensor([1, 2, 0]))) == [[0], [0, 1], [0, 1, 2, 3]]
    # top_p keeps the smallest prefix reaching the mass: 0.5 | 0.5+0.3 | 0.5+0.3+0.15
    assert kept(apply_top_p(rows, torch.tensor([0.4, 0.7, 0.9]))) == [[0], [0, 1], [0, 1, 2]]
    # min_p drops p < min_p * 0.5
    assert kept(apply_min_p(rows, torch.tensor([0.2, 0.4, 0.0]))) == [[0, 1, 2], [0, 1], [0, 1, 2, 3]]


def test_repetition_penalty_follows_hf_convention():
    from transformers import RepetitionPenaltyLogitsProcessor

    from mstar.services.engines.sampling import SeenTokens

    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    history = [0, 1, 1]
    seen = SeenTokens()
    ours = apply_repetition_penalty(logits.clone(), seen.masks([history], 4, logits.device), [2.0])
    assert ours.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # positive divided, negative multiplied
    hf = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([history]), logits.clone())
    torch.testing.assert_close(ours, hf)
    history.append(3)  # the mask follows the growing history incrementally
    ours = apply_repetition_penalty(logits.clone(), seen.masks([history], 4, logits.device), [2.0])
    torch.testing.assert_close(ours, RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([history]), logits.clone()))


def test_greedy_is_deterministic_and_picks_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    p = [SamplingParams(temperature=0)] * 4
    a, b = Sampler()(logits, p), Sampler()(logits, p)
    assert a.tolist() == b.tolist() == logits.argmax(-1).tolist()


def _draws(seed, n=12, other_rows=0):
    """n tokens from a flat distribution for one seeded request, batched with unseeded rows."""
    gen = make_generator(seed, "cpu")
    logits = torch.zeros(1 + other_rows, 1000)
    params = [SamplingParams(seed=seed)] + [SamplingParams()] * other_rows
    return [int(Sampler()(logits, params, generators=[gen] + [None] * other_rows)[0]) for _ in range(n)]


def test_same_seed_same_tokens_different_seed_differs():
    assert _draws(1) == _draws(1)
    assert _draws(1) == _draws(1, other_rows=3)  # independent of what else shares the batch
    assert _draws(1) != _draws(2)


def test_allowed_ranges_are_respected():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(3))
    logits[:, 0] = 50.0  # the unconstrained favourite lies outside the ranges
    ranges = ((10, 20), (90, 95))
    params = [SamplingParams(seed=s, allowed_token_ranges=ranges) for s in (1, 2)]
    gens = [make_generator(1, "cpu"), make_generator(2, "cpu")]
    seen = {int(t) for _ in range(100) for t in Sampler()(logits, params, generators=gens)}
    assert seen and all(10 <= t < 20 or 90 <= t < 95 for t in seen)
    greedy = Sampler()(logits, [SamplingParams(temperature=0, allowed_token_ranges=ranges)] * 2)
    inside = torch.cat([torch.arange(10, 20), torch.arange(90, 95)])
    assert greedy.tolist() == inside[logits[:, inside].argmax(-1)].tolist()


def test_rows_with_different_params_in_one_batch():
    logits = LOGITS.repeat(3, 1)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, seed=0), SamplingParams(top_p=0.7, seed=0)]
    gens = [None, make_generator(0, "cpu"), make_generator(0, "cpu")]
    for _ in range(20):
        t = Sampler()(logits, params, generators=gens).tolist()
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
