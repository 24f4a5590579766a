"""The micro-scheduler on a fake cache that only counts pages."""

import pytest

from mstar.services.engines import OutOfPages, SamplingParams, Scheduler, SchedulerConfig, SeqStatus
from mstar.services.engines.sequence import Sequence

PS = 4  # tokens per page


class FakeCache:
    def __init__(self, num_pages: int):
        self.total = num_pages
        self.held: dict[tuple[str, str], int] = {}

    @property
    def num_free_pages(self) -> int:
        return self.total - sum(self.held.values())

    def pages_needed(self, rid, label, num_tokens):
        return max(0, -(-num_tokens // PS) - self.held.get((rid, label), 0))

    def reserve(self, rid, label, num_tokens):
        need = self.pages_needed(rid, label, num_tokens)
        if need > self.num_free_pages:
            raise OutOfPages(need, self.num_free_pages, self.total)
        self.held[(rid, label)] = self.held.get((rid, label), 0) + need

    def truncate(self, rid, label):
        pass

    def free_seq(self, rid, label):
        self.held.pop((rid, label), None)


def seq(rid, n=4, key=("node", "walk"), max_tokens=100):
    return Sequence(rid, list(range(n)), SamplingParams(temperature=0, max_tokens=max_tokens), key)


def run_step(s: Scheduler, token=1):
    out = s.schedule()
    s.update_from_output(out, [token if c.samples else None for c in out.chunks])
    return out


def shape(out):
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_status_order_means_something():
    assert SeqStatus.WAITING < SeqStatus.RUNNING < SeqStatus.PREEMPTED
    assert all(s.finished for s in SeqStatus if s > SeqStatus.PREEMPTED)
    assert not any(s.finished for s in SeqStatus if s <= SeqStatus.PREEMPTED)


def test_admits_new_requests_into_the_running_batch():
    s = Scheduler(FakeCache(100))
    s.add(seq("a", 5))
    assert shape(run_step(s)) == [("a", 0, 5)]
    assert shape(run_step(s)) == [("a", 5, 1)]
    s.add(seq("b", 3))
    assert shape(run_step(s)) == [("a", 6, 1), ("b", 0, 3)]  # decode and prefill in one step
    assert shape(run_step(s)) == [("a", 7, 1), ("b", 3, 1)]


def test_chunked_prefill_under_token_budget_counts_not_flags():
    s = Scheduler(FakeCache(100), SchedulerConfig(max_num_batched_tokens=8))
    s.add(seq("a", 3))
    run_step(s)
    s.add(seq("b", 20))
    outs = [run_step(s) for _ in range(3)]
    assert [shape(o) for o in outs] == [
        [("a", 3, 1), ("b", 0, 7)], [("a", 4, 1), ("b", 7, 7)], [("a", 5, 1), ("b", 14, 6)]
    ]
    b = s.running[1]
    assert [c.samples for c in (o.chunks[1] for o in outs)] == [False, False, True]
    assert b.num_computed_tokens == 20 and b.num_tokens == 21  # one token sampled, not yet computed


def test_round_robin_across_node_walk_keys():
    s = Scheduler(FakeCache(100), SchedulerConfig(max_num_seqs=4))
    for i in range(4):
        s.add(seq(f"x{i}", key=("llm", "text")))
    for i in range(2):
        s.add(seq(f"y{i}", key=("tts", "audio")))
    assert [c.seq.request_id for c in s.schedule().chunks] == ["x0", "y0", "x1", "y1"]


def test_queues_when_pages_run_out_then_admits():
    cache = FakeCache(4)
    s = Scheduler(cache)
    s.add(seq("a", 12, max_tokens=2))  # 3 pages, 4 with its first decode token
    s.add(seq("b", 8))
    out = run_step(s)
    assert shape(out) == [("a", 0, 12)]
    assert [q.request_id for q in s.waiting[("node", "walk")]] == ["b"]  # queued, not failed
    run_step(s)  # a decodes to its max_tokens and finishes
    cache.free_seq("a", "main")  # the engine's release
    assert shape(run_step(s)) == [("b", 0, 8)]


def test_preempts_newest_running_when_a_page_is_needed_then_recomputes():
    s2 = Scheduler(FakeCache(3))
    s2.add(seq("old", 4))
    s2.add(seq("new", 4))
    run_step(s2)  # both prefilled: one full page each, each sampled a 5th token
    out = s2.schedule()  # each needs a second page: only one left -> newest is preempted
    assert shape(out) == [("old", 4, 1)]
    assert [v.request_id for v in out.preempted] == ["new"]
    victim = out.preempted[0]
    assert victim.status is SeqStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert s2.cache.held.get(("new", "main")) is None  # its pages were freed
    s2.update_from_output(out, [7])
    s2.abort("old")
    out = s2.schedule()
    assert shape(out) == [("new", 0, 5)]  # recompute: prompt plus the token it had sampled


def test_abort_frees_and_too_long_sequence_is_aborted_not_queued():
    cache = FakeCache(4)
    s = Scheduler(cache, SchedulerConfig(max_pages_per_seq=4))
    s.add(seq("a", 5))
    run_step(s)
    assert cache.num_free_pages == 2
    assert [q.request_id for q in s.abort("a")] == ["a"] and cache.num_free_pages == 4
    s.add(seq("huge", 16))  # 16 tokens + 1 sampled need 5 pages > 4
    out = s.schedule()
    assert out.chunks == () and [q.request_id for q in out.aborted] == ["huge"]
    assert out.aborted[0].status is SeqStatus.FINISHED_ABORTED and not s.has_work


@pytest.mark.parametrize("stop,max_tokens,status", [((9,), 100, SeqStatus.FINISHED_STOPPED),
                                                     ((), 2, SeqStatus.FINISHED_LENGTH)])
def test_stop_token_and_max_tokens_finish(stop, max_tokens, status):
    s = Scheduler(FakeCache(10))
    q = Sequence("a", [1, 2], SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=stop))
    s.add(q)
    run_step(s, token=5)
    events = s.update_from_output(s.schedule(), [9])
    assert events[-1].status is status and q.output_ids == [5, 9] and not s.running


def imported(cache, rid, n, computed, outputs=1, max_tokens=100):
    """A sequence handed over with K/V of ``computed`` tokens, which ``cache`` now holds."""
    q = Sequence.resumed(rid, list(range(n)), SamplingParams(temperature=0, max_tokens=max_tokens), outputs, computed)
    cache.reserve(rid, "main", computed)
    return q


def test_a_resumed_sequence_runs_its_rest_and_counts_its_outputs():
    cache = FakeCache(10)
    s = Scheduler(cache)
    q = imported(cache, "a", 6, 5, outputs=1, max_tokens=3)
    assert (q.num_prompt_tokens, q.num_output_tokens, q.num_uncomputed_tokens) == (5, 1, 1)
    s.add(q)
    assert shape(run_step(s, token=7)) == [("a", 5, 1)]  # the handed-over output, not the prompt
    assert shape(run_step(s, token=8)) == [("a", 6, 1)]
    assert q.output_ids == [5, 7, 8] and q.status is SeqStatus.FINISHED_LENGTH  # 3 outputs in all


def test_waiting_kv_is_dropped_only_when_nothing_runs():
    """Two imports fill the cache: the first cannot grow by a page. Nothing runs that could
    free one, so the newer import's K/V goes (it stays queued in its place, to recompute)."""
    cache = FakeCache(4)
    s = Scheduler(cache)
    a, b = imported(cache, "a", 9, 8), imported(cache, "b", 9, 8)  # 2 pages each; position 8 needs a third
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert shape(out) == [("a", 8, 1)] and out.preempted == (b,)
    assert (b.status, b.num_computed_tokens, ("b", "main") in cache.held) == (SeqStatus.PREEMPTED, 0, False)
    assert list(s.waiting[b.key]) == [b]
    c = imported(cache, "c", 5, 4)  # the last free page; b (9 tokens) cannot be admitted
    s.add(c)
    out = run_step(s)
    assert shape(out) == [("a", 9, 1)] and out.preempted == ()  # a runs: c's K/V is kept
    assert cache.held[("c", "main")] == 1
