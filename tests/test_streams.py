"""Chunk policies cut streams exactly as documented."""

import torch

from mstar.models.graph import FixedChunks, LeftContext, SlidingWindow
from mstar.services.node_group.streams import Chunker


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
