"""Prefill and decode in different node groups (models/orpheus/configs/pd_disaggregated.yaml):
the prompt's K/V move to the decode group with the first token, and every token the LLM draws is
exactly the colocated one, greedy and seeded (the audio too, up to the PCM rounding of fp32 SNAC
decodes batched differently). Pages are freed on both groups after success, cancellation and a
failed import."""

import asyncio

import grpc
import pytest
import yaml
from prometheus_client import REGISTRY
from test_orpheus_mesh import LONG_SEED, speak
from test_orpheus_tp import PCM_TOL, pcm16

from mstar.config import load_config
from mstar.models.orpheus.llm_node import OrpheusLLM

from helpers import cancel_and_drain, collect, run, wait_released
from inprocess import inprocess_mesh

CONFIGS = "models/orpheus/configs"
TEXTS = [("Hello there.", {"temperature": 0, "seed": 1}), ("A longer sentence, to speak.", {"temperature": 0, "seed": 2}),
         ("Seeded.", {"temperature": 0.8, "seed": 7, "repetition_penalty": 1.5})]  # seeds tell the requests apart


def config(tmp_path, name):
    cfg = yaml.safe_load(open(f"{CONFIGS}/{name}.yaml"))
    cfg["model_kwargs"]["snac_noise"] = False
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


async def speech(mesh):
    res = await asyncio.gather(*(collect(mesh.stub, speak(t, max_tokens=84, **kw), timeout=120) for t, kw in TEXTS))
    return [(b"".join(c.data for c in out["audio"]), final.usage.completion_tokens, final.finish_reason)
            for out, final in res]


@pytest.fixture
def drawn(monkeypatch):
    """Every token the LLM node hands out, by (request's seed, walk, iteration)."""
    seen: dict = {}
    outputs = OrpheusLLM.outputs

    def record(self, call, output):
        out = outputs(self, call, output)
        seen[(call.kwargs["seed"], call.walk, call.iteration)] = int(out["token"])
        return out

    monkeypatch.setattr(OrpheusLLM, "outputs", record)
    return seen


def pages(mesh, group):
    return mesh.runtime(group).submodules["llm"].kv_stats().pages_used


async def settled(mesh, group, used0, timeout=15.0):
    """Pages in use once the engine applied the releases (they go with its next step)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while pages(mesh, group) != used0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    return pages(mesh, group)


def test_disaggregated_speech_equals_colocated_and_frees_pages(weights, tmp_path, drawn):
    async def colocated():
        async with inprocess_mesh(config(tmp_path, "default"), cache_dir=weights) as mesh:
            return await speech(mesh)

    async def disaggregated():
        async with inprocess_mesh(config(tmp_path, "pd_disaggregated"), cache_dir=weights) as mesh:
            assert mesh.runtime("prefill").submodules["llm"].hands_off
            assert not mesh.runtime("decode").submodules["llm"].hands_off
            p0, d0 = pages(mesh, "prefill"), pages(mesh, "decode")
            got = await speech(mesh)
            await wait_released(mesh)
            assert await settled(mesh, "prefill", p0) == p0 and await settled(mesh, "decode", d0) == d0
            # the K/V crossed the groups: one tensor per request on edge 'kv', none back
            kv = REGISTRY.get_sample_value("mstar_edge_tensors_total", {"src": "prefill", "dst": "decode", "edge": "kv",
                                                                        "transport": "inline"})
            assert kv == len(TEXTS)
            return got

    want = run(colocated(), timeout=240)
    want_tokens = dict(drawn)
    drawn.clear()
    got = run(disaggregated(), timeout=240)
    assert len(want_tokens) > 3 * 20 and drawn == want_tokens
    assert [(n, why) for _, n, why in got] == [(n, why) for _, n, why in want]
    for (g, _, _), (w, _, _) in zip(got, want, strict=True):
        assert len(g) == len(w) > 0 and int((pcm16(g) - pcm16(w)).abs().max()) <= PCM_TOL


def test_cancel_and_a_failed_import_free_both_groups(weights, tmp_path):
    async def go():
        async with inprocess_mesh(config(tmp_path, "pd_disaggregated"), cache_dir=weights) as mesh:
            p0, d0 = pages(mesh, "prefill"), pages(mesh, "decode")
            call = mesh.stub.Generate(speak("A long one.", request_id="long", max_tokens=2000, seed=LONG_SEED), timeout=60)
            await call.read()  # audio flows: the decode group holds the imported pages
            assert pages(mesh, "decode") > d0 and await settled(mesh, "prefill", p0) == p0
            await cancel_and_drain(mesh, call, "long")
            assert await settled(mesh, "decode", d0) == d0

            engine = mesh.runtime("decode").submodules["llm"].engine.engine

            def refuse(*a, **kw):
                raise RuntimeError("no room for the hand-off")

            engine.import_request = refuse
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(mesh.stub, speak("Refused.", max_tokens=40), timeout=60)
            assert e.value.code() == grpc.StatusCode.INTERNAL and "no room for the hand-off" in e.value.details()
            await wait_released(mesh)
            assert await settled(mesh, "prefill", p0) == p0 and await settled(mesh, "decode", d0) == d0
    run(go(), timeout=120)
