"""The Thinker's and the Talker's decode passes as ``decode_graphs.py`` runs them (the CUDA graphs'
body, eagerly on the CPU): padded rows change no real row's output or K/V; a span bucket change
mid-sequence keeps the greedy tokens of the exact-span pass; the scratch slot is never handed
out; a failed capture falls back to the same pass, eagerly."""

import pytest
import torch
from test_engines import prompts

from mstar.models.qwen3_omni.cache import Decode, SlotCache
from mstar.models.qwen3_omni.decode_graphs import batch_buckets, span_bucket
from mstar.models.qwen3_omni.layers import SparseMoe
from mstar.models.qwen3_omni.positions import mrope_positions
from mstar.models.qwen3_omni.sampling import GREEDY, Sampling
from mstar.models.qwen3_omni.talker_engine import TalkerEngine
from mstar.models.qwen3_omni.thinker_engine import ThinkerEngine, ThinkerStart
from mstar.services.engines.loop_graph import CaptureFailed, LoopGraphs, pad_rows


def test_span_and_batch_buckets():
    assert [span_bucket(n, 8192) for n in (0, 5, 127, 128, 255, 256, 5000)] == [128, 128, 128, 256, 256, 512, 8192]
    assert [span_bucket(n, 100, min_span=8) for n in (0, 7, 8, 31, 32, 64, 99)] == [8, 8, 16, 32, 64, 100, 100]
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32) and batch_buckets(3) == (1, 2, 4)
    assert batch_buckets(1) == (1,) and batch_buckets(200) == (1, 2, 4, 8, 16, 32, 64)


def test_the_scratch_slot_is_never_handed_out():
    cache = SlotCache(1, 3, 8, 1, 4, "cpu", torch.float32)
    assert cache.scratch == 3 and cache.k[0].shape[0] == 4 and cache.num_slots == 3
    taken = {cache.take() for _ in range(3)}
    assert taken == {0, 1, 2}
    with pytest.raises(RuntimeError, match="no free KV slot"):
        cache.take()
    for s in taken:
        cache.give_back(s)
    assert {cache.take() for _ in range(3)} == {0, 1, 2}


def test_a_decode_past_the_cache_is_refused_before_it_runs(parts):
    engine = ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 2, 16)
    with pytest.raises(ValueError, match="sequence of 17 tokens is longer than the cache's max_len=16"):
        engine._decode_pass(torch.tensor([1, 2]), torch.zeros(3, 2), [0, 1], [3, 16])
    assert engine.decode.loops == {}  # refused before any span's graphs were made


def filled(cache: SlotCache, seed: int) -> list[torch.Tensor]:
    """Random K/V in every slot (what earlier steps left); returns a copy to restore."""
    g = torch.Generator().manual_seed(seed)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return [t.clone() for t in cache.k + cache.v]


def restore(cache: SlotCache, saved: list[torch.Tensor]) -> None:
    for t, s in zip(cache.k + cache.v, saved, strict=True):
        t.copy_(s)


def body_run(decode, inputs: dict[str, torch.Tensor], span: int):
    """One run of the graphs' body as a capture would record it (eagerly)."""
    return decode.loop(span).body(inputs, 0)


def engines(parts):
    thinker = ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 8, 64)
    talker = TalkerEngine(parts.talker, parts.specials(), 8, 64)
    g = torch.Generator().manual_seed(5)
    ids = {"ids": torch.randint(0, parts.cfg.text.vocab_size, (5,), generator=g)}
    embeds = {"embeds": torch.randn(5, parts.cfg.talker.hidden_size, generator=g)}
    return [(thinker, ids), (talker, embeds)]


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= 1e-6 * want.abs().max())


@pytest.mark.parametrize("which", [0, 1], ids=["thinker", "talker"])
@torch.inference_mode()
def test_padded_rows_change_no_real_row(parts, which, monkeypatch):
    """5 real rows padded to 8 as a graph pads them (copies of the last row): the real rows'
    outputs and K/V are those of the same 8 rows whose padding holds other content and claims a
    real sequence's slot and next position, bit for bit (padded rows write the scratch slot only),
    and the unpadded pass's to the CPU BLAS's last bits (MKL computes a row of a 5-row product
    with another kernel than of an 8-row one for some shapes: the Talker's Linear(H, 1) gate). The
    MoE runs its gathered-weights path: on the grouped GEMM the padded rows' experts would change
    the groups' sizes, and with them the real rows' last bits."""
    for model in (parts.thinker, parts.talker):
        for m in model.modules():
            if isinstance(m, SparseMoe):
                monkeypatch.setattr(m, "path", "gather")
    engine, model_inputs = engines(parts)[which]
    cache, decode = engine.cache, engine.decode
    slots, lengths = [2, 0, 3, 5, 6], [5, 9, 3, 7, 1]
    positions = torch.tensor([[5.0, 11, 3, 8, 1], [5, 11, 4, 8, 1], [5, 11, 7, 8, 1]])  # [3, B]; row 2: 3-D
    inputs = decode.inputs(slots, lengths, positions, **model_inputs)
    span = decode.span(max(lengths))
    real, free = torch.tensor(slots), torch.tensor([1, 4, 7])
    saved = filled(cache, 1)
    unpadded = body_run(decode, inputs, span)
    unpadded_cache = [t.clone() for t in cache.k + cache.v]

    restore(cache, saved)  # padded as a graph's static inputs are
    want = body_run(decode, {k: pad_rows(v, 8) for k, v in inputs.items()}, span)
    want_cache = [t.clone() for t in cache.k + cache.v]
    for k in unpadded:
        assert close(want[k][:5], unpadded[k]), k
    for now, before, then in zip(want_cache, saved, unpadded_cache, strict=True):
        assert close(now[real], then[real])
        assert torch.equal(now[free], before[free])
    assert not torch.equal(want_cache[0][cache.scratch], saved[0][cache.scratch])  # the padded rows wrote here

    restore(cache, saved)  # padded rows that claim row 0's slot and next position, with other content
    odd = {k: pad_rows(v, 8) for k, v in inputs.items()}
    odd["slots"][5:], odd["lengths"][5:] = slots[0], lengths[0]
    odd["positions"][5:] += 7
    name = next(iter(model_inputs))
    odd[name][5:] = model_inputs[name][:3].flip(0)
    got = body_run(decode, odd, span)
    for k in want:
        assert torch.equal(got[k][:5], want[k][:5]), k
    for now, then in zip(cache.k + cache.v, want_cache, strict=True):
        assert torch.equal(now[real], then[real])
        assert torch.equal(now[free], then[free])


def start(parts, ids, max_tokens):
    i = parts.cfg.ids
    pos, delta = mrope_positions(ids, audio_id=i.audio, image_id=i.image, video_id=i.video)
    return ThinkerStart(torch.tensor(ids), pos, delta, GREEDY, max_tokens, ())  # no stop: every step decodes


def decode_all(engine, parts, max_tokens=40):
    """Greedy tokens of three sequences decoded together, and each decode pass's logits."""
    logits = []
    run = engine._decode_pass

    def recorded(*args):
        out = run(*args)
        logits.append(out[0].clone())
        return out

    engine._decode_pass = recorded
    for k, ids in enumerate(prompts(parts)):
        engine.submit(f"r{k}", start(parts, ids, max_tokens))
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            tokens.setdefault(o.request_id, []).append(o.token_id)
    return tokens, logits


def exact_span_pass(engine):
    """The decode pass as it ran before the graphs: eager, attending max(lengths) + 1 keys."""

    def run(ids, positions, slots, lengths):
        embeds = engine.model.embed(ids)
        ctx = Decode(engine.cache, torch.tensor(slots), torch.tensor(lengths), max(lengths) + 1)
        hidden, _ = engine.model(embeds, positions, ctx)
        return engine.model.logits(hidden), embeds

    return run


def test_span_bucket_changes_keep_the_tokens(parts):
    """Prompts of 14, 21, 28 tokens and 40 more each: the step's span goes 32 -> 64 -> 128."""
    before = ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 4, 128)
    before._decode_pass = exact_span_pass(before)
    want, want_logits = decode_all(before, parts)
    now = ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 4, 128)
    now.decode.min_span = 8
    got, logits = decode_all(now, parts)
    assert sorted(now.decode.loops) == [32, 64, 128]
    assert got == want and all(len(t) == 40 for t in got.values())
    assert len(logits) == len(want_logits) == 39
    for a, b in zip(logits, want_logits, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def failing_captures(monkeypatch, bucket: int) -> list[tuple[int, ...]]:
    """LoopGraphs.run raising CaptureFailed whenever it has buckets (as a failed CUDA capture does),
    eager otherwise; returns the buckets of every run, appended as they come."""
    eager, tried = LoopGraphs.run, []

    def failing(self, inputs):
        tried.append(self.buckets)
        if self.buckets:
            raise CaptureFailed(f"loop '{self.name}': capturing bucket {bucket} failed: out of memory")
        return eager(self, inputs)

    monkeypatch.setattr(LoopGraphs, "run", failing)
    return tried


def test_a_failed_capture_turns_graphs_off_and_reruns_eagerly(parts, monkeypatch, caplog):
    """As on CUDA when a capture raises: logged, that engine's decode runs eagerly from then on."""
    want, _ = decode_all(ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 4, 128), parts, 6)
    engine = ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 4, 128)
    engine.decode.graphs = True  # as a CUDA engine's; its LoopGraphs get the batch buckets
    tried = failing_captures(monkeypatch, 4)
    got, _ = decode_all(engine, parts, 6)
    assert got == want
    assert tried[0] == (1, 2, 4) and all(b == () for b in tried[1:]) and len(tried) == 6
    assert not engine.decode.graphs and "thinker decode: CUDA graphs off" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (decode passes as CUDA graph replays)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.inference_mode()
def test_cuda_graph_replays_equal_the_eager_body(checkpoint, dtype):
    """On CUDA: 3 and 5 rows (batch buckets 4 and 8) at two span buckets, each pass a graph
    replay; outputs and the real slots' K/V as the same body's eager run on the same cache gives
    (bfloat16 runs the MoE's grouped GEMM; the batch shapes differ, so within a tolerance)."""
    from mstar.models.qwen3_omni.direct import load_parts

    p = load_parts(checkpoint, "cuda", dtype, ("thinker", "talker"))
    g = torch.Generator().manual_seed(7)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for engine, make in ((ThinkerEngine(p.thinker, p.cfg.accept_hidden_layer, 8, 256),
                          lambda b: {"ids": torch.randint(0, p.cfg.text.vocab_size, (b,), generator=g)}),
                         (TalkerEngine(p.talker, p.specials(), 8, 256),
                          lambda b: {"embeds": torch.randn(b, p.cfg.talker.hidden_size, generator=g).to("cuda", dtype)})):
        decode = engine.decode
        assert decode.graphs and decode.buckets == (1, 2, 4, 8)
        for slots, lengths in (([2, 0, 3], [5, 9, 3]), ([1, 4, 0, 6, 7], [130, 4, 77, 129, 200])):
            b = len(slots)
            positions = torch.tensor(lengths, dtype=torch.float32).expand(3, b)
            model_inputs = make(b)
            saved = filled(engine.cache, 3)
            got = decode.run(slots, lengths, positions, **model_inputs)
            got_cache = [t.clone() for t in engine.cache.k + engine.cache.v]
            restore(engine.cache, saved)
            inputs = {k: v.to("cuda") for k, v in decode.inputs(slots, lengths, positions, **model_inputs).items()}
            want = body_run(decode, inputs, decode.span(max(lengths)))
            for k in want:
                assert (got[k].float() - want[k].float()).abs().max() <= tol * want[k].float().abs().max(), k
            real = torch.tensor(slots, device="cuda")
            for now, then in zip(got_cache, engine.cache.k + engine.cache.v, strict=True):
                assert (now[real].float() - then[real].float()).abs().max() <= tol * then[real].float().abs().max()
        assert decode.graphs and sorted(decode.loops) == [128, 256]  # no capture failed
        assert [loop.stats.graph_replays for loop in decode.loops.values()] == [1, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Code2Wav chunks as CUDA graph replays)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.inference_mode()
def test_code2wav_chunk_graphs_equal_the_eager_decode(checkpoint, dtype):
    """On CUDA: chunks of 1 and 3 rows (buckets 1 and 4), a first chunk, a full one and a partial
    last one (padded to a full chunk's length), each a graph replay, against ``decode_chunk``
    eagerly (the batch and chunk lengths differ, so within a tolerance)."""
    from mstar.models.qwen3_omni.code2wav import ChunkGraphs
    from mstar.models.qwen3_omni.direct import load_parts

    dec = load_parts(checkpoint, "cuda", dtype, ("code2wav",)).code2wav
    graphs = ChunkGraphs(dec, "cuda", chunk=10)
    codes = torch.randint(0, 64, (3, dec.cfg.num_quantizers, 35), generator=torch.Generator().manual_seed(13)).cuda()
    # fp32: cuDNN picks its convolution algorithm per shape (a graph's batch is padded to its
    # bucket), and they differ by up to ~1e-4 of the largest sample (8e-5 seen on an H200)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for rows in (1, 3):
        for context, new in ((0, 4), (25, 10), (25, 3)):
            chunk = codes[:rows, :, : context + new]
            got, want = graphs.decode(chunk, context).float(), dec.decode_chunk(chunk, context).float()
            assert got.shape == want.shape
            assert (got - want).abs().max() <= tol * want.abs().max(), (rows, context, new)
    assert sum(loop.stats.graph_replays for loop in graphs.loops.values()) == 6
    assert sum(loop.stats.eager_runs for loop in graphs.loops.values()) == 0


def test_a_failed_predictor_capture_turns_its_graphs_off_and_reruns_eagerly(parts, monkeypatch, caplog):
    """The code predictor's frame loop, as on CUDA when a capture raises: logged, the same codes
    eagerly from then on."""
    from mstar.models.qwen3_omni.predictor_loop import PredictorLoop
    from mstar.models.qwen3_omni.talker import PREDICTOR_SAMPLING

    cp = parts.talker.code_predictor
    h = cp.cfg.hidden_size
    hidden, e0 = torch.randn(2, h, generator=torch.Generator().manual_seed(1)), torch.randn(2, h)
    greedy = torch.ones(2, dtype=torch.bool)
    with torch.inference_mode():
        want = PredictorLoop(cp, PREDICTOR_SAMPLING, torch.device("cpu"), False).run(hidden, e0, greedy, [None, None])
    loop = PredictorLoop(cp, PREDICTOR_SAMPLING, torch.device("cpu"), True)  # buckets as a CUDA loop's
    tried = failing_captures(monkeypatch, 2)
    with torch.inference_mode():
        got = loop.run(hidden, e0, greedy, [None, None])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert tried[0] and tried[1:] == [()] and loop.loop.buckets == ()
    assert "code predictor: CUDA graphs off" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (host syncs are a CUDA notion)")
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_decode_step_waits_for_the_device_once(checkpoint, monkeypatch, sampled):
    """On CUDA, after a warm-up answer: each Talker decode step blocks the host once (the codes'
    copy), each Thinker decode step twice (its tokens, then the text rows for the Talker, already
    computed by then). Every other upload is asynchronous: a blocking host-to-device copy waits for
    all the queued work, and the GPU idles while the host prepares what comes next. ``sampled``:
    unseeded sampling with the request knobs' defaults (served requests' usual case: one draw)."""
    import traceback
    import warnings

    from mstar.models.qwen3_omni.direct import generate, load_parts

    p = load_parts(checkpoint, "cuda", torch.bfloat16, ("thinker", "talker", "code2wav"))
    ids = prompts(p)[0]
    syncs: dict[str, list[list[str]]] = {"thinker": [], "talker": []}  # per step, where each sync was made

    def counting(name, step):
        def run(self):
            where: list[str] = []

            def show(message, *args, **kwargs):
                if "synchronizing" in str(message):
                    where.append("".join(traceback.format_stack(limit=6)[:-1]))

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = step(self)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs[name].append(where)
            return out
        return run

    kw = dict(thinker_sampling=Sampling(0.7, 20, 0.8), talker_sampling=Sampling(0.9, 50, 1.0)) if sampled else {}
    generate(p, ids, max_tokens=6, talker_max_tokens=8, **kw)  # graphs captured, kernels compiled
    monkeypatch.setattr(ThinkerEngine, "step", counting("thinker", ThinkerEngine.step))
    monkeypatch.setattr(TalkerEngine, "step", counting("talker", TalkerEngine.step))
    generate(p, ids, max_tokens=6, talker_max_tokens=8, **kw)
    for name, want in (("thinker", 2), ("talker", 1)):
        assert len(syncs[name]) >= 2, syncs  # the counting ran: a prefill, then decode steps
        for where in syncs[name][1:]:  # the first step: the prefill
            assert len(where) == want, f"{name} step: {len(where)} host syncs, made at\n" + "\n".join(where)
