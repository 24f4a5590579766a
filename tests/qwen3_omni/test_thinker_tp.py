"""The Thinker tensor-parallel over two CPU ranks (gloo): each rank loads only its shard
(heads, experts, vocab rows) of the tiny checkpoint; TP=2's logits are as close to transformers'
fp32 reference as TP=1's, and its engine draws TP=1's greedy tokens (text and a prompt with
media rows) and hands the Talker the same prompt rows.

Tolerance: max |TP=2 - reference| <= 1e-4 x max |reference| (the parity bar of test_parts.py)
and <= 2 x TP=1's own max error + 1e-6 x max |reference| (the all-reduces only reorder fp32
sums: same error order as TP=1, not a looser bar)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch

from mstar.models.qwen3_omni.cache import NoCache
from mstar.models.qwen3_omni.positions import mrope_positions
from mstar.models.qwen3_omni.prompt import talker_prompt
from mstar.models.qwen3_omni.sampling import GREEDY
from mstar.models.qwen3_omni.thinker_engine import ThinkerEngine, ThinkerStart
from mstar.models.qwen3_omni.thinker_tp import ThinkerShard

from helpers import run_ranks

JOIN_TIMEOUT_S = 180
RTOL = 1e-4


def text_ids(n: int = 23) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(3))


def starts(cfg) -> dict[str, ThinkerStart]:
    """Three text prompts (two with the Talker's prompt rows) and one with 5 audio rows."""
    i, g = cfg.ids, torch.Generator().manual_seed(21)
    out = {}
    for k in range(3):
        text = torch.randint(0, 256, (5 + 7 * k,), generator=g).tolist()
        ids = [i.im_start, i.user, 10, *text, i.im_end, 10, i.im_start, i.assistant, 10]
        pos, delta = mrope_positions(ids, audio_id=i.audio, image_id=i.image, video_id=i.video)
        tp = talker_prompt(ids, i) if k < 2 else None
        out[f"text{k}"] = ThinkerStart(torch.tensor(ids), pos, delta, GREEDY, 8, (), talker_rows=tp.rows if tp else None,
                                       talker_mm=tp.mm if tp else None)
    ids = [i.im_start, i.user, 10, i.audio_start, *[i.audio] * 5, i.audio_start + 1, 72, 105, i.im_end, 10,
           i.im_start, i.assistant, 10]
    pos, delta = mrope_positions(ids, audio_id=i.audio, image_id=i.image, video_id=i.video, audio_rows=[5])
    rows = torch.randn(5, cfg.text.hidden_size, generator=g)
    tp = talker_prompt(ids, i)
    out["audio"] = ThinkerStart(torch.tensor(ids), pos, delta, GREEDY, 8, (), {i.audio: rows},
                                talker_rows=tp.rows, talker_mm=tp.mm)
    return out


def text_logits(thinker, cfg) -> torch.Tensor:
    ids = text_ids()
    pos, _ = mrope_positions(ids.tolist(), audio_id=-1, image_id=-2, video_id=-3)
    h, _ = thinker(thinker.embed(ids), pos, NoCache())
    return thinker.logits(h)


def run_engine(engine: ThinkerEngine, cfg) -> dict:
    """Every prompt at once, then each decode step batched; greedy tokens and Talker rows."""
    for rid, work in starts(cfg).items():
        engine.submit(rid, work)
    tokens: dict[str, list[int]] = {}
    rows = {}
    while engine.has_work:
        for o in engine.step():
            assert o.error is None, o.error
            tokens.setdefault(o.request_id, []).append(o.token_id)
            if o.extra and "talker_prompt" in o.extra:
                rows[o.request_id] = o.extra["talker_prompt"]
    return {"tokens": tokens, "talker_rows": rows}


def _rank_main(rank: int, ckpt: str, init: str, out: str) -> None:
    from mstar.models.qwen3_omni.direct import load_parts
    from mstar.services.engines.tensor_parallel import TensorParallel, TPSpec

    torch.set_num_threads(1)
    tp = TensorParallel(TPSpec(rank, 2, init), "cpu")
    p = load_parts(ckpt, parts=("thinker",), tp=tp)
    with torch.inference_mode():
        logits = text_logits(p.thinker, p.cfg)  # every rank runs the pass (its collectives)
    engine = ThinkerEngine(p.thinker, p.cfg.accept_hidden_layer, 4, 64, tp=tp)
    if rank == 0:
        res = run_engine(engine, p.cfg)
        engine.close()
        layer = p.thinker.model.layers[0]
        res |= {"logits": logits, "heads": (layer.self_attn.heads, layer.self_attn.kv_heads),
                "experts": tuple(layer.mlp.experts.gate_up.shape), "vocab_rows": tuple(p.thinker.lm_head.weight.shape),
                "cache": tuple(engine.cache.k[0].shape)}
        torch.save(res, out)
    else:
        engine.follow()
    torch.distributed.barrier()  # both done before either tears the group down
    tp.close()


@pytest.fixture(scope="module")
def tp2(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("thinker_tp") / "rank0.pt"
    run_ranks(_rank_main, (checkpoint, f"file://{out.parent}/store", str(out)), JOIN_TIMEOUT_S)
    return torch.load(out)


def test_each_rank_holds_its_shard(tp2, parts):
    c = parts.cfg.text  # tiny: 4 q heads, 2 KV heads, 8 experts, vocab 320
    assert tp2["heads"] == (c.num_heads // 2, c.num_kv_heads // 2)
    assert tp2["experts"] == (c.num_experts // 2, 2 * c.moe_intermediate_size, c.hidden_size)
    assert tp2["vocab_rows"] == (c.vocab_size // 2, c.hidden_size)
    assert tp2["cache"][2] == c.num_kv_heads // 2  # each rank caches its KV heads only ([slots, len, kv, d])


def test_tp2_logits_as_close_to_the_reference_as_tp1(tp2, parts, reference):
    with torch.no_grad():
        ref = reference.thinker(input_ids=text_ids()[None]).logits[0]
        tp1 = text_logits(parts.thinker, parts.cfg)
    scale = float(ref.abs().max())
    err1, err2 = float((tp1 - ref).abs().max()), float((tp2["logits"] - ref).abs().max())
    print(f"max |logit error| vs fp32 transformers: TP=1 {err1:.3g}, TP=2 {err2:.3g} (max |ref| {scale:.3g})")
    assert err2 <= RTOL * scale
    assert err2 <= 2 * err1 + 1e-6 * scale, (err1, err2)


def test_tp2_greedy_tokens_and_talker_rows_equal_tp1(tp2, parts):
    want = run_engine(ThinkerEngine(parts.thinker, parts.cfg.accept_hidden_layer, 4, 64), parts.cfg)
    assert tp2["tokens"] == want["tokens"]
    assert all(len(t) == 8 for t in want["tokens"].values())
    assert want["talker_rows"].keys() == tp2["talker_rows"].keys() == {"text0", "text1", "audio"}
    for rid, rows in want["talker_rows"].items():
        torch.testing.assert_close(tp2["talker_rows"][rid], rows, atol=1e-5, rtol=1e-5)


@dataclass(frozen=True)
class RankOnly:
    """A rank for loading weights only (no process group)."""

    rank: int
    size: int


@pytest.mark.parametrize("weights", ["checkpoint", "random"])
def test_each_rank_loads_its_slices(checkpoint, tmp_path, weights):
    """Every parameter of a rank is its slice of TP=1's (safetensors slices read; the random
    weights a full-size benchmark makes on load, sliced the same way)."""
    from mstar.models.qwen3_omni.direct import load_parts
    from mstar.models.qwen3_omni.weights import RANDOM_MARKER

    d = checkpoint
    if weights == "random":
        shutil.copy(f"{checkpoint}/config.json", tmp_path / "config.json")
        (tmp_path / RANDOM_MARKER).write_text(json.dumps({"seed": 5, "std": 0.1}))
        d = str(tmp_path)
    full = load_parts(d, parts=("thinker",))
    want = full.thinker.state_dict()
    for rank in (0, 1):
        shard = ThinkerShard(full.cfg.text, rank, 2)
        got = load_parts(d, parts=("thinker",), tp=RankOnly(rank, 2)).thinker.state_dict()
        assert got.keys() == want.keys()
        for name, t in got.items():
            cut = shard.split(name)
            assert torch.equal(t, want[name] if cut is None else want[name].narrow(cut[0], cut[1], cut[2] - cut[1])), name


def test_shapes_that_do_not_split_are_refused_and_kv_heads_replicate(parts):
    c = parts.cfg.text
    with pytest.raises(ValueError, match="thinker num_attention_heads=4 does not split over tp_size=3"):
        ThinkerShard(c, 0, 3)
    # 4 ranks over 2 KV heads: each rank holds the one KV head its q head reads
    assert [(s.kv_heads, s.kv_first) for s in (ThinkerShard(c, r, 4) for r in range(4))] == [(1, 0), (1, 0), (1, 1), (1, 1)]
