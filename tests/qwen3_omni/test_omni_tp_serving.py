"""Qwen3-Omni served with the Thinker tensor-parallel over two ranks (configs/tp2.yaml), as real
processes on the CPU (gloo): the same text tokens (greedy) and speech as the one-group layout."""

import asyncio
import json

import grpc
import numpy as np
import pytest

from mstar.config import load_config
from mstar.launcher import LaunchOptions, Mesh
from mstar.services.links import CHANNEL_OPTIONS
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

from helpers import collect, run, started_mesh
from inprocess import inprocess_mesh

CONFIGS = "models/qwen3_omni/configs"
REQUESTS = [("Hello there, how are you?", 12, 20), ("Tell me a story.", 8, 10)]
pytestmark = pytest.mark.e2e


def ask(text: str, max_tokens: int, frames: int) -> cpb.GenerateRequest:
    kw = dict(temperature=0.0, talker_temperature=0.0, max_tokens=max_tokens, max_audio_frames=frames)
    return cpb.GenerateRequest(model="qwen3_omni", text=text, model_kwargs_json=json.dumps(kw))


async def answers(stub) -> list[tuple[list[int], np.ndarray]]:
    res = await asyncio.gather(*(collect(stub, ask(*r), timeout=120) for r in REQUESTS))
    return [([t for c in out["text"] for t in c.token_ids],
             np.frombuffer(b"".join(c.data for c in out.get("audio", [])), dtype=np.int16)) for out, _ in res]


def test_tp2_thinker_serves_the_one_group_answers(cache_dir):
    async def one_group():
        async with inprocess_mesh(load_config(f"{CONFIGS}/default.yaml"), cache_dir=cache_dir) as mesh:
            return await answers(mesh.stub)

    want = run(one_group(), timeout=180)
    path = f"{CONFIGS}/tp2.yaml"
    mesh = started_mesh(lambda: Mesh(load_config(path), LaunchOptions(path, port=0, grpc_port=0, cache_dir=cache_dir,
                                                                       log_level="WARNING", startup_timeout_s=180)))
    try:
        async def tp2():
            async with grpc.aio.insecure_channel(mesh.conductor_address, options=CHANNEL_OPTIONS) as ch:
                return await answers(conductor_pb2_grpc.ConductorStub(ch))

        got = run(tp2(), timeout=180)
    finally:
        mesh.stop()
    for (tokens, pcm), (want_tokens, want_pcm) in zip(got, want, strict=True):
        assert tokens == want_tokens and len(tokens) > 1
        assert pcm.size and pcm.shape == want_pcm.shape
        assert np.abs(pcm.astype(np.int32) - want_pcm).max() <= 3  # same codes; fp32 decodes in other batches
