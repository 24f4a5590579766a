"""LoopGraphs: a fixed-shape loop run as one CUDA graph per batch bucket, or eagerly.

CPU: the eager loop against a hand-written one, padding, validation errors, stats. GPU (marked
``gpu``): graph vs eager in bf16, static buffers refilled per run, one graph per bucket, and the
replay faster than the eager loop."""

from __future__ import annotations

import logging
import statistics

import pytest
import torch

from mstar.services.engines.loop_graph import LoopGraphs, pad_rows

STEPS, DT = 8, 1.0 / 8
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_weights(d: int, h: int, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w1, w2, wt = (torch.randn(d, h, generator=gen) / d**0.5, torch.randn(h, d, generator=gen) / h**0.5,
                  torch.randn(h, generator=gen))
    return tuple(w.to(device, dtype) for w in (w1, w2, wt))


def flow_body(w):
    """x <- x + dt * MLP(x, cond, t_i): an Euler step of a flow-matching velocity field; t_i is
    a Python float from the step index, frozen into a captured graph."""
    w1, w2, wt = w

    def body(state, i):
        x, cond = state["x"], state["cond"]
        t = 1.0 - i * DT
        v = torch.tanh(x @ w1 + cond[:, None, :] + t * wt) @ w2
        return {"x": x + DT * v, "v": v}

    return body


def hand_loop(x, cond, w, steps=STEPS):
    w1, w2, wt = w
    for i in range(steps):
        v = torch.tanh(x @ w1 + cond.unsqueeze(1) + (1.0 - i * DT) * wt) @ w2
        x = x + DT * v
    return x, v


def make_inputs(b: int, d=16, h=32, tokens=4, device="cpu", dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(b, tokens, d, generator=gen).to(device, dtype),
            "cond": torch.randn(b, h, generator=gen).to(device, dtype)}


@pytest.mark.parametrize("b", [1, 3, 8, 40])
def test_eager_run_matches_hand_written_loop(b):
    w = make_weights(16, 32)
    loop = LoopGraphs(flow_body(w), STEPS, ("x",), "cpu")
    inp = make_inputs(b)
    out = loop.run(inp)
    x, v = hand_loop(inp["x"], inp["cond"], w)
    assert set(out) == {"x", "v"} and out["x"].shape == (b, 4, 16)
    torch.testing.assert_close(out["x"], x, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out["v"], v, atol=1e-6, rtol=1e-6)  # the last iteration's non-carried output
    assert not torch.equal(out["x"], inp["x"])  # the loop did something
    assert loop.stats.eager_runs == 1 and loop.stats.graph_replays == 0 and loop.num_graphs == 0


def test_iteration_index_runs_zero_to_n_minus_one():
    seen = []
    loop = LoopGraphs(lambda s, i: seen.append(i) or {"x": s["x"] + i}, 5, ("x",), "cpu")
    out = loop.run({"x": torch.zeros(2, 3)})
    assert seen == [0, 1, 2, 3, 4] and torch.equal(out["x"], torch.full((2, 3), 10.0))


@pytest.mark.parametrize("b", [1, 3, 5])
def test_padding_rows_repeat_the_last_row_and_leave_valid_rows_alone(b):
    w = make_weights(16, 32)
    inp = make_inputs(b)
    padded = {k: pad_rows(v, 8) for k, v in inp.items()}
    for k, v in padded.items():  # rows past b are row b-1, so a norm of a padded row is no 0/0
        assert torch.equal(v[:b], inp[k]) and torch.equal(v[b:], inp[k][b - 1:b].expand_as(v[b:]))
    loop = LoopGraphs(flow_body(w), STEPS, ("x",), "cpu")
    got, want = loop.run(padded), loop.run(inp)
    torch.testing.assert_close(got["x"][:b], want["x"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got["x"][b:], want["x"][b - 1:b].expand_as(got["x"][b:]), atol=1e-6, rtol=1e-6)


def test_no_buckets_or_cpu_count_eager_runs():
    w = make_weights(16, 32)
    for loop in (LoopGraphs(flow_body(w), STEPS, ("x",), "cpu"),
                 LoopGraphs(flow_body(w), STEPS, ("x",), "cpu", buckets=())):
        for b in (1, 2, 64):
            loop.run(make_inputs(b))
        assert (loop.stats.eager_runs, loop.stats.graph_replays, loop.stats.captures, loop.num_graphs) == (3, 0, 0, 0)
        assert loop.bucket(1) is None


def test_warm_runs_every_bucket_on_cuda_and_nothing_elsewhere(monkeypatch):
    loops = LoopGraphs(lambda s, i: {"x": s["x"] + 1}, 2, ("x",), "cpu", buckets=(4, 1, 2))
    runs = []
    monkeypatch.setattr(LoopGraphs, "run", lambda self, inputs: runs.append({k: v.shape for k, v in inputs.items()}))
    example = {"x": torch.zeros(3), "c": torch.ones(2, 5)}
    loops.warm(example)
    assert runs == []  # a CPU loop has no graphs to make
    loops.device = torch.device("cuda")  # as a CUDA loop's (run is the recorder: nothing touches a GPU)
    loops.warm(example)
    assert runs == [{"x": (b, 3), "c": (b, 2, 5)} for b in (1, 2, 4)]


def test_input_errors_name_the_fields():
    loop = LoopGraphs(flow_body(make_weights(16, 32)), STEPS, ("x",), "cpu", name="denoise")
    inp = make_inputs(3)
    with pytest.raises(ValueError, match=r"'denoise': inputs have different batch sizes.*x=3, cond=2"):
        loop.run({"x": inp["x"], "cond": inp["cond"][:2]})
    with pytest.raises(ValueError, match=r"carried \['x'\] not among the inputs \(cond\)"):
        loop.run({"cond": inp["cond"]})
    with pytest.raises(ValueError, match=r"input 'cond' must be a tensor with a batch dim 0"):
        loop.run({"x": inp["x"], "cond": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="no rows"):
        loop.run({"x": inp["x"][:0], "cond": inp["cond"][:0]})


@pytest.mark.parametrize("body,match", [
    (lambda s, i: {"v": s["x"]}, r"iteration 0 lacks carried 'x' \(it returned v\)"),
    (lambda s, i: {"x": s["x"][..., :2]}, r"iteration 0: carried 'x' is \[3, 4, 2\] torch.float32, its input is \[3, 4, 16\]"),
    (lambda s, i: {"x": s["x"].double()}, r"carried 'x' is \[3, 4, 16\] torch.float64, its input is \[3, 4, 16\] torch.float32"),
    (lambda s, i: {"x": s["x"] if i < 2 else s["x"].half()}, r"iteration 2: carried 'x' is .* torch.float16"),
    (lambda s, i: {"x": s["x"], "loss": s["x"].sum()}, r"'loss' is \[\], not a tensor of 3 rows"),
    (lambda s, i: s["x"], r"iteration 0 is a Tensor, not a dict"),
])
def test_body_output_errors_name_the_fields(body, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LoopGraphs(body, STEPS, ("x",), "cpu").run(make_inputs(3))


def test_constructor_errors():
    body = flow_body(make_weights(16, 32))
    with pytest.raises(TypeError, match=r"carried must be a tuple of names, e.g. \('x',\)"):
        LoopGraphs(body, STEPS, "x", "cpu")
    with pytest.raises(ValueError, match="iterations must be >= 1, got 0"):
        LoopGraphs(body, 0, ("x",), "cpu")
    with pytest.raises(ValueError, match=r"buckets must be positive ints, got \[4, 0\]"):
        LoopGraphs(body, STEPS, ("x",), "cpu", buckets=(4, 0))
    with pytest.raises(ValueError, match="carried names repeat"):
        LoopGraphs(body, STEPS, ("x", "x"), "cpu")


# --- GPU -------------------------------------------------------------------------------------------

#: bf16 graph vs eager, per element: |graph - eager| <= ATOL + RTOL * |eager|. The same kernels in
#: the same order; a bucket's larger M may pick another cuBLAS kernel (another summation order):
#: a few bf16 ulps (eps 2^-8 = 3.9e-3) of values of order 1 after the loop's steps.
ATOL = RTOL = 2e-2


def rms_flow_body(w):
    """The flow body with an RMSNorm in front (a zero padding row would be 0/0 there)."""
    w1, w2, wt = w

    def body(state, i):
        x, cond = state["x"], state["cond"]
        hn = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        v = torch.tanh(hn @ w1 + cond[:, None, :] + (1.0 - i * DT) * wt) @ w2
        return {"x": x + DT * v, "v": v}

    return body


def gpu_pair(d=256, h=512, buckets=(1, 2, 4, 8, 16, 32), steps=STEPS):
    w = make_weights(d, h, "cuda", torch.bfloat16)
    return (LoopGraphs(rms_flow_body(w), steps, ("x",), "cuda", buckets=buckets, name="graph"),
            LoopGraphs(rms_flow_body(w), steps, ("x",), "cuda", buckets=(), name="eager"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("b,bucket", [(1, 1), (3, 4), (16, 16), (40, None)])
def test_graph_matches_eager_bf16(b, bucket, caplog):
    graph, eager = gpu_pair()
    inp = make_inputs(b, 256, 512, 8, "cuda", torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="mstar.services.engines.loop_graph"):
        got = graph.run(inp)
    want = eager.run(inp)
    assert graph.bucket(b) == bucket
    for k in ("x", "v"):
        assert got[k].shape == want[k].shape and not got[k].isnan().any()
        torch.testing.assert_close(got[k].float(), want[k].float(), atol=ATOL, rtol=RTOL)
    graphed = bucket is not None
    assert (graph.stats.graph_replays, graph.stats.eager_runs, graph.num_graphs) == (int(graphed), int(not graphed),
                                                                                     int(graphed))
    assert eager.stats.eager_runs == 1 and eager.num_graphs == 0
    logged = [r.getMessage() for r in caplog.records if "captured" in r.getMessage()]
    assert len(logged) == int(graphed)
    if graphed:
        assert f"bucket {bucket} (cond:[512] bfloat16, x:[8, 256] bfloat16)" in logged[0]


@pytest.mark.gpu
@needs_cuda
def test_second_run_refills_static_buffers_and_first_outputs_stay():
    graph, eager = gpu_pair()
    a, b = (make_inputs(3, 256, 512, 8, "cuda", torch.bfloat16, seed=s) for s in (1, 2))
    out_a = graph.run(a)
    kept = out_a["x"].clone()
    out_b = graph.run(b)
    torch.testing.assert_close(out_b["x"].float(), eager.run(b)["x"].float(), atol=ATOL, rtol=RTOL)
    assert not torch.allclose(out_b["x"].float(), kept.float(), atol=0.1)  # really the new inputs' result
    assert torch.equal(out_a["x"], kept)  # outputs are clones: the second replay left them alone
    assert graph.num_graphs == 1 and graph.stats.graph_replays == 2


@pytest.mark.gpu
@needs_cuda
def test_one_graph_per_bucket():
    graph, _ = gpu_pair()
    graph.run(make_inputs(3, 256, 512, 8, "cuda", torch.bfloat16))
    graph.run(make_inputs(4, 256, 512, 8, "cuda", torch.bfloat16))
    assert graph.num_graphs == 1 and graph.stats.captures == 1 and graph.stats.graph_replays == 2
    graph.run(make_inputs(4, 256, 512, 16, "cuda", torch.bfloat16))  # another per-row shape: another graph
    graph.run(make_inputs(5, 256, 512, 8, "cuda", torch.bfloat16))  # another bucket
    assert graph.num_graphs == 3 and graph.stats.captures == 3


def median_ms(fn, reps=20, warm=3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


@pytest.mark.gpu
@needs_cuda
def test_replay_faster_than_eager_for_ten_small_steps():
    graph, eager = gpu_pair(d=128, h=256, steps=10)
    inp = make_inputs(4, 128, 256, 8, "cuda", torch.bfloat16)
    graph_ms, eager_ms = median_ms(lambda: graph.run(inp)), median_ms(lambda: eager.run(inp))
    assert graph.stats.captures == 1 and eager.num_graphs == 0
    assert graph_ms < eager_ms, f"graph {graph_ms:.3f} ms vs eager {eager_ms:.3f} ms"


@pytest.mark.gpu
@needs_cuda
def test_failed_capture_raises():
    w = make_weights(16, 32, "cuda", torch.bfloat16)
    inner = flow_body(w)

    def syncing(state, i):  # .item() is a host sync: fine eagerly (the warm-up), not capturable
        out = inner(state, i)
        return out if out["x"].float().abs().sum().item() >= 0 else out

    loop = LoopGraphs(syncing, STEPS, ("x",), "cuda")
    with pytest.raises(RuntimeError, match=r"loop 'loop': capturing bucket 4 \(.*\) failed"):
        loop.run(make_inputs(3, device="cuda", dtype=torch.bfloat16))
    assert loop.num_graphs == 0 and loop.stats.captures == 0
