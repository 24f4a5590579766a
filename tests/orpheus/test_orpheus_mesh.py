"""Orpheus served by the mesh (CPU, tiny random checkpoint in the real layout)."""

import asyncio
import io
import json
import wave

import grpc
import pytest

from mstar.config import load_config
from mstar.v1 import conductor_pb2 as cpb

from helpers import cancel_and_drain, collect, run, wait_released
from inprocess import inprocess_mesh

CONFIGS = "models/orpheus/configs"
# "A long one." with this seed runs to max_tokens=2000 on the random test weights (seed 2 samples
# end-of-speech at 231 tokens): a request that must still be running when it is cancelled
LONG_SEED = 1


def speak(text, request_id="", **kw):
    return cpb.GenerateRequest(model="orpheus", text=text, request_id=request_id, model_kwargs_json=json.dumps(kw))


def to_wav(pcm: bytes, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return buf.getvalue()


@pytest.mark.parametrize("config", ["default", "disaggregated"])
def test_speech_through_the_mesh(weights, config):
    async def go():
        async with inprocess_mesh(load_config(f"{CONFIGS}/{config}.yaml"), cache_dir=weights) as mesh:
            res = await asyncio.gather(*(collect(mesh.stub, speak("Hello there.", max_tokens=70, seed=s), timeout=120)
                                         for s in (1, 2)))
            pcms = []
            for out, final in res:
                chunks = out["audio"]
                assert {c.sample_rate_hz for c in chunks} == {24000} and {c.mime_type for c in chunks} == {"audio/pcm"}
                pcm = b"".join(c.data for c in chunks)
                # 70 tokens = 10 frames of 7 SNAC codes = 10 * 2048 samples: every frame reaches the client
                assert len(pcm) == 10 * 2048 * 2
                assert final.usage.audio_seconds == pytest.approx(10 * 2048 / 24000)
                assert final.finish_reason == "length"  # max_tokens, not end-of-speech
                assert final.usage.completion_tokens == 70
                with wave.open(io.BytesIO(to_wav(pcm, 24000))) as w:
                    assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (24000, 1, 10 * 2048)
                pcms.append(pcm)
            assert pcms[0] != pcms[1]  # different seeds, different speech
            await wait_released(mesh)
    run(go(), timeout=240)


def test_knobs_are_validated(weights):
    async def go():
        async with inprocess_mesh(load_config(f"{CONFIGS}/default.yaml"), cache_dir=weights) as mesh:
            for kw, field in [({"voice": "bob"}, "model_kwargs.voice"), ({"temperature": 3}, "model_kwargs.temperature"),
                              ({"top_p": 0}, "model_kwargs.top_p"), ({"repetition_penalty": 0.5}, "model_kwargs.repetition_penalty"),
                              ({"max_tokens": 0}, "model_kwargs.max_tokens"),
                              ({"max_tokens": 6}, "model_kwargs.max_tokens"),  # less than a frame: never audio ({"seed": -1}, "model_kwargs.seed"),
                              ({"speed": 2}, "model_kwargs.speed")]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(mesh.stub, speak("hi", **kw))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), kw
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(mesh.stub, speak("  "))
            assert "text" in e.value.details()
    run(go(), timeout=120)


def test_cancel_frees_kv_pages(weights):
    async def go():
        async with inprocess_mesh(load_config(f"{CONFIGS}/default.yaml"), cache_dir=weights) as mesh:
            llm = mesh.runtime("llm").submodules["llm"]
            used0 = llm.kv_stats().pages_used
            call = mesh.stub.Generate(speak("A long one.", max_tokens=2000, request_id="long", seed=LONG_SEED), timeout=60)
            await call.read()  # audio is flowing: the request holds pages
            assert llm.kv_stats().pages_used > used0
            await cancel_and_drain(mesh, call, "long")
            for _ in range(200):
                if llm.kv_stats().pages_used == used0 and not llm.engine.has_work:
                    break
                await asyncio.sleep(0.02)
            driver = mesh.runtime("llm").drivers["llm"]
            assert llm.kv_stats().pages_used == used0 and not driver._waiting and not driver._early and not driver._held
    run(go(), timeout=120)


def test_window_knobs():
    from mstar.models.orpheus.model import OrpheusModel

    def policy(**kw):
        (decode,) = [w for w in OrpheusModel(kw).build_walks() if w.name == "decode"]
        (edge,) = [e for e in decode.edges if e.streaming]
        return edge.policy.first_rows, edge.policy.window, edge.policy.stride

    assert policy() == (21, 28, 7) and policy(first_window_frames=4) == (28, 28, 7)
    assert policy(snac_stride_frames=3) == (21, 42, 21)
    for bad in (2, 5, True, "3", 3.0):
        with pytest.raises(ValueError, match="model_kwargs.first_window_frames must be 3 or 4"):
            policy(first_window_frames=bad)
    for bad in (0, 9, 1.0, None):
        with pytest.raises(ValueError, match=r"model_kwargs.snac_stride_frames must be an integer in \[1, 8\]"):
            policy(snac_stride_frames=bad)


@pytest.mark.parametrize("name", ["default", "disaggregated", "throughput", "tp2"])
def test_shipped_configs_build_their_walks(name):
    from mstar.models.orpheus.model import OrpheusModel

    cfg = load_config(f"{CONFIGS}/{name}.yaml")
    walks = {w.name for w in OrpheusModel(cfg.model_kwargs).build_walks()}
    assert walks == {"prefill", "decode", "snac_chunk"}
