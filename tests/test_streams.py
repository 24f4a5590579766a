"""Chunk policies cut streams exactly as documented."""

import pytest
import torch

from mstar.models.chunker import Chunker
from mstar.models.graph import FixedChunks, LeftContext, SlidingWindow


def cut(policy, n, finish=True):
    c = Chunker(policy)
    out = []
    for i in range(n):
        out += c.push(torch.tensor([i]))
    if finish:
        out += c.finish()
    return [(info.index, info.start, info.new_from, info.final, t.tolist()) for info, t in out]


def test_fixed_chunks_with_and_without_continue_after_done():
    assert cut(FixedChunks(4), 10) == [(0, 0, 0, False, [0, 1, 2, 3]), (1, 4, 4, False, [4, 5, 6, 7]),
                                       (2, 8, 8, True, [8, 9])]
    assert cut(FixedChunks(4, continue_after_done=False), 10) == cut(FixedChunks(4), 8, finish=False)


def test_sliding_window_first_window_then_every_stride():
    got = cut(SlidingWindow(window=4, stride=2), 9)
    assert got == [(0, 0, 0, False, [0, 1, 2, 3]), (1, 2, 4, False, [2, 3, 4, 5]), (2, 4, 6, False, [4, 5, 6, 7]),
                   (3, 5, 8, True, [5, 6, 7, 8])]
    # ending exactly on a stride: the last window has no new rows but still comes, marked final
    assert cut(SlidingWindow(window=4, stride=2), 6)[-1] == (2, 2, 6, True, [2, 3, 4, 5])
    # shorter than one window: one final chunk with everything
    assert cut(SlidingWindow(window=28, stride=7), 5) == [(0, 0, 0, True, [0, 1, 2, 3, 4])]
    # every item is "new" in exactly one chunk
    for n in range(1, 40):
        got = cut(SlidingWindow(window=28, stride=7), n)
        covered = []
        for _, start, new_from, _, items in got:
            covered += items[new_from - start:]
        assert covered == list(range(n)), n


def test_orpheus_window_matches_its_cadence():
    # 28-token window, stride 7: first decode at 28 tokens, then at 35, 42, ...
    c = Chunker(SlidingWindow(window=28, stride=7))
    fired = [i + 1 for i in range(60) if c.push(torch.tensor([i]))]
    assert fired == [28, 35, 42, 49, 56]


def test_sliding_window_with_an_earlier_first_window():
    # Orpheus: the first window at 21 rows (3 frames), then 28-row windows every 7 rows
    c = Chunker(SlidingWindow(window=28, stride=7, first=21))
    fired = [i + 1 for i in range(60) if c.push(torch.tensor([i]))]
    assert fired == [21, 28, 35, 42, 49, 56]
    got = cut(SlidingWindow(window=4, stride=2, first=3), 8)
    assert got == [(0, 0, 0, False, [0, 1, 2]), (1, 1, 3, False, [1, 2, 3, 4]), (2, 3, 5, False, [3, 4, 5, 6]),
                   (3, 4, 7, True, [4, 5, 6, 7])]
    for n in range(1, 40):  # still every item "new" in exactly one chunk
        covered = []
        for _, start, new_from, _, items in cut(SlidingWindow(window=28, stride=7, first=21), n):
            covered += items[new_from - start:]
        assert covered == list(range(n)), n


def test_a_ramp_brings_no_more_new_rows_than_the_windows_before_it():
    """Qwen3-Omni's codec edge with a 4-frame first chunk: windows of 35 rows (25 of context + 10),
    new rows 4, 4, 8, then 10 each (ramp), instead of 4, then 10 each."""
    ramp = Chunker(SlidingWindow(window=35, stride=10, first=4, ramp=True))
    assert [i + 1 for i in range(60) if ramp.push(torch.tensor([i]))] == [4, 8, 16, 26, 36, 46, 56]
    flat = Chunker(SlidingWindow(window=35, stride=10, first=4))
    assert [i + 1 for i in range(60) if flat.push(torch.tensor([i]))] == [4, 14, 24, 34, 44, 54]
    for n in range(1, 70):  # every item "new" in exactly one chunk, each window at most 35 long
        covered = []
        for _, start, new_from, _, items in cut(SlidingWindow(window=35, stride=10, first=4, ramp=True), n):
            assert len(items) <= 35 and start == max(0, new_from + len(items[new_from - start:]) - 35)
            covered += items[new_from - start:]
        assert covered == list(range(n)), n


@pytest.mark.parametrize("make, field", [(lambda: SlidingWindow(window=4, stride=5), "stride"),
                                         (lambda: SlidingWindow(window=4, stride=0), "stride"),
                                         (lambda: SlidingWindow(window=4, stride=2, first=5), "first"),
                                         (lambda: SlidingWindow(window=4, stride=2, first=0), "first"),
                                         (lambda: FixedChunks(0), "size"),
                                         (lambda: LeftContext(chunk=0, left_context=1), "chunk"),
                                         (lambda: LeftContext(chunk=2, left_context=-1), "left_context")])
def test_bad_policies_are_refused_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_left_context():
    assert cut(LeftContext(chunk=3, left_context=2), 8) == [
        (0, 0, 0, False, [0, 1, 2]), (1, 1, 3, False, [1, 2, 3, 4, 5]), (2, 4, 6, True, [4, 5, 6, 7])]


def test_chunker_keeps_only_what_it_still_needs():
    c = Chunker(SlidingWindow(window=8, stride=2))
    for i in range(1000):
        c.push(torch.tensor([i]))
    assert c.rows.shape[0] <= 8 + 2


def test_policies_count_rows_not_iterations():
    # iterations may add no row (nothing to stream) or several
    c = Chunker(FixedChunks(3))
    got = []
    for item in ([0], [], [1, 2, 3, 4], [], [5]):
        got += c.push(torch.tensor(item, dtype=torch.int64))
    got += c.finish()
    assert [(i.index, i.start, t.tolist()) for i, t in got] == [(0, 0, [0, 1, 2]), (1, 3, [3, 4, 5])]


def test_remote_stream_sends_one_frame_per_chunk_and_the_receiver_cuts_the_same_chunks(toy_config):
    """A sender holds stream rows until they complete a chunk the receiver will cut."""
    from mstar.config import Placement
    from mstar.models.registry import create_model
    from mstar.services.node_group.requests import RequestCtx, Send
    from mstar.services.node_group.router import Router

    config = toy_config()  # decoder streams to the 'audio' group under all three policies
    model = create_model(config.model, config.model_kwargs)
    router = Router("decoder", model, Placement(config, model))
    plan = model.plans["generate"]
    edges = plan.streams
    assert {router.placement.host(e.topology.dst_walk, e.dst) for e in edges} == {"audio"}
    for n in (3, 8, 13, 29):
        req = RequestCtx("r", kwargs={})
        inst = router.instance(req, ("generate", 0, -1))
        for e in edges:
            out = []
            direct = Chunker(e.policy)
            expected = []
            for i in range(n):
                item = torch.tensor([i]) if i % 5 != 2 else torch.empty(0, dtype=torch.int64)  # some steps stream nothing
                expected += direct.push(item)
                router._stream(req, inst, e, i, item, out)
            expected += direct.finish()
            assert all(type(s) is Send and s.target == "audio" and not s.frame.done for s in out)
            sent = [(e.dst, s.tensors[0][1], False) for s in out]
            sent.append((e.dst, router.held_back(inst, e), True))  # what flush_loop_outputs sends
            receiver, got = Chunker(e.policy), []
            for _, value, done in sent:
                if value is not None:
                    got += receiver.push(value)
                if done:
                    got += receiver.finish()
            assert [(i, t.tolist()) for i, t in got] == [(i, t.tolist()) for i, t in expected], (e.dst, n)
            # one frame per chunk cut before the end (+ the end): not one per item
            assert len(sent) == sum(1 for info, _ in expected if not info.final) + 1, (e.dst, n)
