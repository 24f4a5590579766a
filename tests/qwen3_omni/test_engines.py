"""The Thinker's and the Talker's engines on their own: batched prefill and decode equal each
sequence alone; sequences wait for slots; work an engine cannot take aborts only that request."""

import torch

from mstar.models.qwen3_omni.positions import mrope_positions
from mstar.models.qwen3_omni.prompt import talker_prompt
from mstar.models.qwen3_omni.sampling import GREEDY, Sampling, sample
from mstar.models.qwen3_omni.thinker_engine import ThinkerEngine, ThinkerStart


def prompts(parts, n=3):
    i = parts.cfg.ids
    g = torch.Generator().manual_seed(21)
    out = []
    for k in range(n):
        text = torch.randint(0, 256, (5 + 7 * k,), generator=g).tolist()
        out.append([i.im_start, i.user, 10, *text, i.im_end, 10, i.im_start, i.assistant, 10])
    return out


def start(parts, ids, max_tokens=8):
    i = parts.cfg.ids
    pos, delta = mrope_positions(ids, audio_id=i.audio, image_id=i.image, video_id=i.video)
    tp = talker_prompt(ids, i)
    return ThinkerStart(torch.tensor(ids), pos, delta, GREEDY, max_tokens, (i.im_end,), talker_rows=tp.rows, talker_mm=tp.mm)


def run_engine(engine):
    tokens, prompts_ = {}, {}
    while engine.has_work:
        for o in engine.step():
            tokens.setdefault(o.request_id, []).append(o.token_id)
            if o.extra and "talker_prompt" in o.extra:
                prompts_[o.request_id] = o.extra["talker_prompt"]
            assert o.error is None or o.token_id is None
    return tokens, prompts_


def test_thinker_batch_equals_each_alone(parts):
    ps = prompts(parts)
    together = ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 4, 128)
    for k, ids in enumerate(ps):
        together.submit(f"r{k}", start(parts, ids))
    tokens, rows = run_engine(together)
    for k, ids in enumerate(ps):
        alone = ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 1, 128)
        alone.submit("x", start(parts, ids))
        t, r = run_engine(alone)
        assert tokens[f"r{k}"] == t["x"]
        assert torch.allclose(rows[f"r{k}"], r["x"], atol=1e-5)
    assert together.cache.num_free == 4
    budget = ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 4, 128, max_prefill_tokens=len(ps[0]) + 1)
    for k, ids in enumerate(ps):
        budget.submit(f"r{k}", start(parts, ids))
    assert [o.request_id for o in budget.step()] == ["r0"]  # r1 would pass the step's prompt tokens
    assert tokens == run_engine(budget)[0] | {"r0": tokens["r0"]} and budget.steps > 3


def test_thinker_waits_for_slots_and_refuses_alone(parts):
    ps = prompts(parts)
    eng = ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 1, 64)
    eng.submit("a", start(parts, ps[0]))
    eng.submit("b", start(parts, ps[1]))
    eng.submit("big", start(parts, ps[2], max_tokens=60))  # prompt + max_tokens > 64
    first = eng.step()
    assert {o.request_id for o in first} == {"a", "big"}  # b waits for a's slot
    (big,) = [o for o in first if o.request_id == "big"]
    assert big.token_id is None and big.finished and "max_seq_len=64" in big.error
    tokens, _ = run_engine(eng)
    assert len(tokens["a"]) == 7 and len(tokens["b"]) == 8  # a's first token came with the first step
    assert eng.cache.num_free == 1


def test_sample_places_each_rows_draw():
    """``sample``'s paths: every row unseeded (one draw for the batch), unseeded rows among greedy
    ones, unseeded rows beside a seeded one. With top-k 1 a draw is its row's argmax, so a draw
    written to the wrong row shows; a seeded row draws as it does alone."""
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
    best = logits.argmax(-1)
    one = Sampling(temperature=0.9, top_k=1)
    assert torch.equal(sample(logits, [one] * 5), best)  # all unseeded: one draw, no index
    assert torch.equal(sample(logits, [GREEDY, one, GREEDY, one, one]), best)  # unseeded among greedy rows

    wide = Sampling(temperature=0.9, top_k=10)

    def seeded():
        return torch.Generator().manual_seed(3)
    out = sample(logits, [GREEDY, wide, wide, wide, wide], [None, None, seeded(), None, None])
    assert out[0] == best[0]
    assert out[2] == sample(logits[2:3], [wide], [seeded()])[0]
    top = logits.topk(10).indices
    assert all(out[r] in top[r] for r in (1, 3, 4))
    mixed = sample(logits, [GREEDY, one, one, one, one], [None, None, seeded(), None, None])
    assert torch.equal(mixed, best)  # the unseeded rows' draw written to rows 1, 3, 4
