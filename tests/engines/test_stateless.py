import logging

import torch

from mstar.services.engines import StatelessEngine


class Recorder:
    """A per-token function (padding-safe) that records the batch shapes it sees."""

    def __init__(self):
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 3)
        self.shapes = []

    def __call__(self, x):
        self.shapes.append(tuple(x.shape))
        return torch.tanh(self.lin(x))


def _items(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 6, generator=g) for n in lengths]


def test_groups_by_length_bucket_and_pads_batch_to_bucket():
    fn = Recorder()
    eng = StatelessEngine(fn, batch_sizes=(1, 2, 4), length_buckets=(4, 8))
    items = _items([3, 5, 7, 3, 2])
    outs = eng.run(items)
    assert sorted(fn.shapes) == [(2, 8, 6), (4, 4, 6)]  # {3,3,2} -> 4-bucket x batch 4; {5,7} -> 8 x 2
    assert eng.stats.batches == 2 and eng.stats.padded_rows == 1
    for x, y in zip(items, outs, strict=True):
        assert y.shape == (x.shape[0], 3)
        torch.testing.assert_close(y, fn(x[None])[0], atol=1e-6, rtol=0)


def test_exact_shapes_without_length_buckets_and_batch_split():
    fn = Recorder()
    eng = StatelessEngine(fn, batch_sizes=(1, 2))
    outs = eng.run(_items([4, 4, 4, 5]))
    assert sorted(fn.shapes) == [(1, 4, 6), (1, 5, 6), (2, 4, 6)]  # 3 of length 4 split 2 + 1
    assert [tuple(o.shape) for o in outs] == [(4, 3)] * 3 + [(5, 3)]


def test_compile_flag_runs_the_compiled_function():
    fn = Recorder()
    eng = StatelessEngine(fn, compile=True, compile_backend="eager")
    assert eng.fn is not fn
    items = _items([3, 3])
    outs = eng.run(items)
    torch.testing.assert_close(outs[1], fn(items[1][None])[0], atol=1e-6, rtol=0)


def test_cuda_graphs_switch_off_cleanly_on_cpu(caplog):
    with caplog.at_level(logging.INFO, logger="mstar.services.engines"):
        eng = StatelessEngine(Recorder(), cuda_graphs=True)
    assert not eng.cuda_graphs and "CUDA graphs off: device is cpu" in caplog.text
    assert len(eng.run(_items([2]))) == 1 and eng.stats.graph_replays == 0
