"""The four loop shapes on the tiny model, each against dense attention over the same tokens."""

import torch
from engine_helpers import causal_mask, dense_hidden, make_engine

from mstar.services.engines import ForwardItem, SamplingParams

ATOL = 1e-4


def _embeds(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, model.config.hidden_size, generator=g)


def _prefix(model, ids):
    return model.embed(torch.tensor(ids))


def test_1_autoregressive_decode_appends_one_token_per_step(tiny_model):
    eng = make_engine(tiny_model)
    prompt = [11, 12, 13, 14, 15, 16]
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=5))
    eng.step()  # prefill samples the first token
    tokens = list(prompt) + [eng.scheduler.running[0].token_ids[-1]]
    for _ in range(4):
        before = eng.cache.length("r")
        (ev,) = eng.step()
        assert eng.cache.length("r") == before + 1
        tokens.append(ev.token_id)
    assert ev.status.finished and eng.cache.length("r") == len(prompt) + 4  # kept until release
    eng.release("r")
    assert eng.cache.num_free_pages == eng.cache.allocator.num_usable
    # Each generated token is the dense model's argmax after the tokens before it.
    n = len(tokens)
    h = dense_hidden(tiny_model, _prefix(tiny_model, tokens), torch.arange(n), causal_mask(n))
    assert tiny_model.compute_logits(h[len(prompt) - 1 : -1]).argmax(-1).tolist() == tokens[len(prompt) :]


def test_2_denoising_queries_attend_without_appending(tiny_model):
    eng = make_engine(tiny_model)
    prefix = [3, 1, 4, 1, 5, 9, 2]  # 7 tokens: a partly filled last page
    eng.forward([ForwardItem("r", token_ids=torch.tensor(prefix))])
    free_after_prefix = eng.cache.num_free_pages
    p, q = len(prefix), 5
    mask = causal_mask(p + q)
    mask[p:, :] = True  # queries see the whole prefix and every query
    for step in range(3):  # a new noisy latent each step: nothing of the last step may leak in
        x = _embeds(tiny_model, q, seed=step)
        (h,) = eng.forward([ForwardItem("r", embeds=x, append=False)], causal=False)
        assert eng.cache.length("r") == p
        assert eng.cache.num_free_pages == free_after_prefix
        want = dense_hidden(
            tiny_model, torch.cat([_prefix(tiny_model, prefix), x]), torch.arange(p + q), mask
        )[p:]
        torch.testing.assert_close(h, want, atol=ATOL, rtol=0)


def test_3_labelled_caches_in_one_step(tiny_model):
    eng = make_engine(tiny_model)
    prefixes = {"main": [5, 6, 7, 8, 9, 10, 11, 12, 13], "cfg_text": [5, 6], "cfg_img": [20, 21, 22, 23, 24]}
    eng.forward([ForwardItem("r", label, token_ids=torch.tensor(ids)) for label, ids in prefixes.items()])
    x = _embeds(tiny_model, 4, seed=7)
    hs = eng.forward([ForwardItem("r", label, embeds=x, append=False) for label in prefixes], causal=False)
    for (label, ids), h in zip(prefixes.items(), hs, strict=True):
        p = len(ids)
        mask = causal_mask(p + 4)
        mask[p:, :] = True
        want = dense_hidden(tiny_model, torch.cat([_prefix(tiny_model, ids), x]), torch.arange(p + 4), mask)[p:]
        torch.testing.assert_close(h, want, atol=ATOL, rtol=0, msg=label)
        assert eng.cache.length("r", label) == p
    assert sorted(eng.cache.labels("r")) == ["cfg_img", "cfg_text", "main"]
    start = eng.cache.allocator.num_usable
    eng.release("r")
    assert eng.cache.num_free_pages == start


def test_4_persistent_cache_grows_by_a_block_per_step(tiny_model):
    eng = make_engine(tiny_model)
    prefix, block, steps = [40, 41, 42, 43, 44], 3, 4
    eng.forward([ForwardItem("w", token_ids=torch.tensor(prefix))])
    frames, outs = [], []
    for step in range(steps):
        x = _embeds(tiny_model, block, seed=100 + step)
        (h,) = eng.forward([ForwardItem("w", embeds=x)], causal=False)  # a frame sees itself whole
        frames.append(x)
        outs.append(h)
        assert eng.cache.length("w") == len(prefix) + block * (step + 1)
    n = len(prefix) + block * steps
    mask = causal_mask(n)
    for f in range(steps):  # block-causal: frame f sees the prefix and frames 0..f
        lo = len(prefix) + block * f
        mask[lo : lo + block, : lo + block] = True
    want = dense_hidden(tiny_model, torch.cat([_prefix(tiny_model, prefix), *frames]), torch.arange(n), mask)
    torch.testing.assert_close(torch.cat(outs), want[len(prefix) :], atol=ATOL, rtol=0)
