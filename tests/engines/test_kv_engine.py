"""The KV-cache engine's lifecycle: no page leaks on any path, preemption, switches off on CPU."""

import logging

import pytest
import torch
from engine_helpers import make_engine

from mstar.services.engines import ForwardItem, SamplingParams, SeqStatus, StepFailed

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9, 8, 7], "c": [100, 101, 102, 103, 104, 105, 106, 107, 108]}


def _labelled_extras(eng, rid):
    """Give the request two more labelled caches, as a CFG node would."""
    eng.forward([ForwardItem(rid, "cfg_text", token_ids=torch.tensor([1, 2, 3, 4, 5])),
                 ForwardItem(rid, "cfg_img", token_ids=torch.tensor([6]))])


def test_no_leak_after_finish(tiny_model):
    eng = make_engine(tiny_model)
    start = eng.cache.num_free_pages
    for rid, ids in PROMPTS.items():
        eng.add_request(rid, ids, GREEDY)
        _labelled_extras(eng, rid)
    finished = set()
    while eng.has_work:
        finished |= {e.request_id for e in eng.step() if e.status.finished}
    assert finished == set(PROMPTS) and eng.cache.num_free_pages < start  # K/V kept until release
    for rid in PROMPTS:
        eng.release(rid)
    assert eng.cache.num_free_pages == start and eng.cache.request_ids() == []


def test_no_leak_after_cancel_of_unfinished_request(tiny_model):
    eng = make_engine(tiny_model)
    start = eng.cache.num_free_pages
    eng.add_request("a", PROMPTS["a"], GREEDY)
    eng.add_request("b", PROMPTS["b"], GREEDY)  # stays running
    _labelled_extras(eng, "a")
    eng.step()
    eng.step()
    eng.release("a")
    assert [s.request_id for s in eng.scheduler.running] == ["b"]
    eng.release("b")
    assert eng.cache.num_free_pages == start and not eng.has_work


def test_no_leak_after_exception_in_forward(tiny_model, monkeypatch):
    eng = make_engine(tiny_model)
    start = eng.cache.num_free_pages
    for rid, ids in PROMPTS.items():
        eng.add_request(rid, ids, GREEDY)
    _labelled_extras(eng, "a")
    eng.step()
    fail = {"on": True, "calls": 0}
    real = type(eng.runner).run

    def flaky(self, *a, **k):
        if not fail["on"]:
            return real(self, *a, **k)
        fail["calls"] += 1
        raise RuntimeError("device fell over")

    monkeypatch.setattr(type(eng.runner), "run", flaky)
    with pytest.raises(StepFailed) as e:
        eng.step()
    assert e.value.request_ids == ["a", "b", "c"] and fail["calls"] == 1
    assert eng.cache.num_free_pages == start and not eng.has_work
    # A failing direct pass rolls back what it reserved and keeps what was committed.
    fail["on"] = False
    eng.forward([ForwardItem("d", token_ids=torch.tensor([1, 2, 3]))])
    held = eng.cache.num_free_pages
    fail["on"] = True
    with pytest.raises(RuntimeError, match="fell over"):
        eng.forward([ForwardItem("d", token_ids=torch.arange(9)), ForwardItem("d", "cfg", token_ids=torch.arange(5))])
    assert eng.cache.num_free_pages == held and eng.cache.length("d") == 3
    eng.release("d")
    assert eng.cache.num_free_pages == start


def test_no_leak_after_timeout(tiny_model):
    now = [0.0]
    eng = make_engine(tiny_model)
    eng.clock = lambda: now[0]
    start = eng.cache.num_free_pages
    eng.add_request("slow", PROMPTS["c"], GREEDY, timeout_s=1.0)
    eng.add_request("ok", PROMPTS["b"], SamplingParams(temperature=0, max_tokens=50))
    _labelled_extras(eng, "slow")
    eng.step()
    now[0] = 2.0
    events = eng.step()
    assert ("slow", None, SeqStatus.FINISHED_ABORTED) in [(e.request_id, e.token_id, e.status) for e in events]
    assert eng.cache.labels("slow") == []
    eng.release("ok")
    assert eng.cache.num_free_pages == start


def test_preemption_recomputes_and_gives_the_same_tokens(tiny_model):
    params = SamplingParams(temperature=0, max_tokens=12)
    roomy = make_engine(tiny_model, num_pages=64).generate(PROMPTS, params)
    tight = make_engine(tiny_model, num_pages=10)  # 9 usable pages of 4 tokens: 3 sequences cannot all grow
    out = tight.generate(PROMPTS, params)
    assert tight.stats.preemptions > 0
    assert out == roomy
    assert tight.cache.num_free_pages == tight.cache.allocator.num_usable


def test_graphs_and_overlap_switch_off_cleanly_on_cpu(tiny_model, caplog):
    with caplog.at_level(logging.INFO, logger="mstar.services.engines"):
        eng = make_engine(tiny_model, cuda_graphs=True, overlap=True)
    assert not eng.cuda_graphs and not eng.overlap
    assert "CUDA graphs off: device is cpu, not CUDA" in caplog.text
    assert "overlap scheduling off: device is cpu, not CUDA" in caplog.text
    out = eng.generate({"a": PROMPTS["a"]}, GREEDY)
    assert len(out["a"]) == GREEDY.max_tokens and eng.stats.graph_steps == 0


def test_pipelined_decode_gives_the_same_tokens(tiny_model):
    """Pipelined decode (launch step N+1 before reading step N), forced on for CPU."""
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = {"a": PROMPTS["a"], "b": PROMPTS["b"]}
    plain = make_engine(tiny_model, overlap=False).generate(prompts, params)
    eng = make_engine(tiny_model)
    eng.overlap = True
    assert eng.generate(prompts, params) == plain
    assert eng.stats.pipelined_steps >= 4
    assert eng.cache.num_free_pages == eng.cache.allocator.num_usable


CYCLE = (((0, 20),), ((20, 40), (60, 61)), ((40, 60),))  # output i from CYCLE[i % 3]: a codebook-like constraint


def _drive(eng, mode: str):
    """A run with a stop token, a request arriving mid-decode and a release mid-decode."""
    seeded = mode != "greedy"

    def params(n, stop=()):
        extra = dict(repetition_penalty=1.5, allowed_token_cycle=CYCLE) if mode == "penalty+cycle" else {}
        return SamplingParams(temperature=0.8 if seeded else 0, seed=5 if seeded else None, max_tokens=n,
                              stop_token_ids=stop, **extra)

    out: dict[str, list[int]] = {}
    eng.add_request("a", PROMPTS["a"], params(9))
    eng.add_request("b", PROMPTS["b"], params(12))
    for i in range(14):
        if i == 3:
            eng.add_request("c", PROMPTS["c"], params(5))
        if i == 6:
            eng.release("b")
        for e in eng.step():
            if e.token_id is not None:
                out.setdefault(e.request_id, []).append(e.token_id)
            if e.status.finished:
                eng.release(e.request_id)
    while eng.has_work:
        eng.step()
    return out


@pytest.mark.parametrize("mode", ["greedy", "seeded", "penalty+cycle"])
def test_pipelined_decode_with_arrivals_releases_and_seeds(tiny_model, mode):
    """Pipelined steps sample from device-side state only (seen-token masks, the output's
    position in an allowed-token cycle), so they draw exactly what unpipelined steps draw."""
    plain = _drive(make_engine(tiny_model), mode)
    if mode == "penalty+cycle":
        for toks in plain.values():
            assert all(any(a <= t < b for a, b in CYCLE[i % 3]) for i, t in enumerate(toks))
    eng = make_engine(tiny_model)
    eng.overlap = True
    piped = _drive(eng, mode)
    # Released mid-flight, b may have one more token drawn in the pipelined run; all else is equal.
    assert piped["a"] == plain["a"] and piped["c"] == plain["c"]
    assert piped["b"][: len(plain["b"])] == plain["b"] and len(piped["b"]) - len(plain["b"]) in (0, 1)
    assert eng.stats.pipelined_steps > 0
    assert eng.cache.num_free_pages == eng.cache.allocator.num_usable and eng.cache.request_ids() == []


def test_add_request_twice_is_refused(tiny_model):
    eng = make_engine(tiny_model)
    eng.add_request("a", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="release it first"):
        eng.add_request("a", [1, 2], GREEDY)


HEAD_CYCLE = (((0, 20),), ((20, 30), (70, 71)), ((75, 90),))
HEAD = ((0, 30), (70, 90))  # every id HEAD_CYCLE allows, in two ranges


def test_a_restricted_head_draws_what_the_full_head_draws(tiny_model, monkeypatch):
    """EngineConfig.head_ranges: while every row's allowed ranges lie inside them, logits are
    computed for those ids only; the tokens are those of the full head (fp32, same seeds)."""
    def drive(eng, constrained=("a", "b", "c")):
        for rid in ("a", "b", "c"):
            cyc = HEAD_CYCLE if rid in constrained else ()
            eng.add_request(rid, PROMPTS[rid], SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.3,
                                                              seed=7, max_tokens=10, allowed_token_cycle=cyc))
        out: dict[str, list[int]] = {}
        while eng.has_work:
            for e in eng.step():
                out.setdefault(e.request_id, []).append(e.token_id)
                if e.status.finished:
                    eng.release(e.request_id)
        return out

    full = drive(make_engine(tiny_model))
    for toks in full.values():
        assert all(any(a <= t < b for a, b in HEAD_CYCLE[i % 3]) for i, t in enumerate(toks))
    calls = []
    real = tiny_model.compute_logits
    monkeypatch.setattr(tiny_model, "compute_logits", lambda h, ranges=(): calls.append(ranges) or real(h, ranges))
    eng = make_engine(tiny_model, head_ranges=HEAD)
    assert drive(eng) == full
    assert calls and all(r == HEAD for r in calls)  # every step used the restricted head
    # a row without allowed ranges in the batch: that step computes the full head
    calls.clear()
    mixed_full = drive(make_engine(tiny_model), constrained=("a", "c"))
    eng = make_engine(tiny_model, head_ranges=HEAD)
    assert drive(eng, constrained=("a", "c")) == mixed_full
    assert () in calls
    with pytest.raises(ValueError, match="EngineConfig.head_ranges"):
        make_engine(tiny_model, head_ranges=((70, 90), (0, 30)))


def test_warm_sampler_leaves_no_state(tiny_model, monkeypatch):
    """warm_sampler samples each parameter set once on the path steps take (the restricted
    head here) and leaves nothing behind: no request, no tracked sequence, no page; seeded
    generation afterwards is what it is on a fresh engine."""
    calls = []
    eng = make_engine(tiny_model, head_ranges=HEAD)
    sampler = eng.sampler
    monkeypatch.setattr(eng, "sampler", lambda logits, *a, **k: calls.append((tuple(logits.shape), k.get("columns")
                                                                              is not None)) or sampler(logits, *a, **k))
    cyc = SamplingParams(seed=3, repetition_penalty=1.2, allowed_token_cycle=HEAD_CYCLE)
    eng.warm_sampler([cyc.at_output(i) for i in range(3)])
    assert calls == [((3, 50), True)]  # one row per code position, over the 30 + 20 head columns
    assert not eng.has_work and not sampler._slots and eng.cache.allocator.num_used == 0
    monkeypatch.undo()
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=6, allowed_token_cycle=HEAD_CYCLE)
    assert eng.generate({"a": PROMPTS["a"]}, params) == make_engine(tiny_model, head_ranges=HEAD).generate(
        {"a": PROMPTS["a"]}, params)


def test_max_seq_len_sizes_the_cache_and_bounds_sequences(tiny_model):
    """The placement's max_seq_len: the cache must hold one such sequence, and a longer one is
    aborted at admission instead of growing into the cache."""
    with pytest.raises(ValueError, match=r"the KV cache holds 28 tokens, fewer than one sequence of max_seq_len=64: "
                                         r"give it more memory \(kv_cache_bytes, gpu_memory_fraction\) or lower"):
        make_engine(tiny_model, num_pages=8, max_seq_len=64)
    eng = make_engine(tiny_model, num_pages=64, max_seq_len=16)
    assert eng.scheduler.config.max_pages_per_seq == 4  # 16 tokens of 4-token pages
    eng.add_request("long", list(range(1, 18)), GREEDY)  # 17 prompt tokens
    eng.add_request("short", PROMPTS["b"], GREEDY)
    events = eng.step()
    assert ("long", None, SeqStatus.FINISHED_ABORTED) in [(e.request_id, e.token_id, e.status) for e in events]
    assert [e.request_id for e in events if e.token_id is not None] == ["short"]
