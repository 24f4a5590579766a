"""Orpheus with the LLM tensor-parallel over two ranks (configs/tp2.yaml), as real processes
on the CPU (gloo): the same speech as the one-rank placement, and a dead rank takes its
service down instead of hanging requests."""

import asyncio
import json
import os
import signal
import time

import grpc
import pytest
import torch
import yaml

from mstar.config import load_config
from mstar.launcher import LaunchOptions, Mesh
from mstar.services.links import CHANNEL_OPTIONS
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

from helpers import collect, run
from inprocess import inprocess_mesh

CONFIGS = "models/orpheus/configs"
TEXTS = ("Split in two.", "Two halves, one voice.")
# PCM16 steps: fp32 SNAC decodes of the same codes in other batches round a few samples
# the other way (one changed token would change a whole frame by far more)
PCM_TOL = 2
pytestmark = pytest.mark.e2e


def config(tmp_path, name: str) -> str:
    """The shipped config without SNAC's decoder noise: the audio then depends on the codes
    only, so equal audio means the LLM drew equal tokens."""
    cfg = yaml.safe_load(open(f"{CONFIGS}/{name}.yaml"))
    cfg["model_kwargs"]["snac_noise"] = False
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def speak(text: str) -> cpb.GenerateRequest:
    # greedy: seeded draws from the near-flat distributions of random weights can flip on
    # a rounding difference; an argmax does not
    kw = {"max_tokens": 70, "temperature": 0.0, "repetition_penalty": 1.2}
    return cpb.GenerateRequest(model="orpheus", text=text, model_kwargs_json=json.dumps(kw))


async def speech(address: str, texts) -> list[bytes]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        res = await asyncio.gather(*(collect(stub, speak(t), timeout=120) for t in texts))
    return [b"".join(c.data for c in out["audio"]) for out, _final in res]


def pcm16(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.int16).int()


def follower_pids(pid: int) -> list[int]:
    kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [int(k) for k in kids if "--tp-rank" in open(f"/proc/{k}/cmdline").read().split("\0")]


def test_tp2_speaks_like_one_rank_and_a_dead_rank_stops_its_service(weights, tmp_path):
    async def one_rank():
        async with inprocess_mesh(load_config(config(tmp_path, "disaggregated")), cache_dir=weights) as mesh:
            return await speech(mesh.address, TEXTS)

    want = run(one_rank(), timeout=180)
    tp2 = config(tmp_path, "tp2")
    mesh = Mesh(load_config(tp2), LaunchOptions(tp2, port=0, grpc_port=0, cache_dir=weights, log_level="WARNING",
                                                 startup_timeout_s=120))
    mesh.start()
    try:
        got = run(speech(mesh.conductor_address, TEXTS), timeout=180)
        assert [len(p) for p in got] == [10 * 2048 * 2] * 2
        assert got[0] != got[1]
        for g, w in zip(got, want, strict=True):  # same codes; SNAC batched its windows otherwise
            assert int((pcm16(g) - pcm16(w)).abs().max()) <= PCM_TOL
        kill_child_and_expect_the_service_down(mesh, "llm", follower_pids)
    finally:
        mesh.stop()


def kill_child_and_expect_the_service_down(mesh: Mesh, service: str, children) -> None:
    """SIGKILL the one child ``children(pid)`` finds under ``service``: the service must exit 1
    within 15 s, and a new request then fails UNAVAILABLE (not hang)."""
    svc = next(s for s in mesh.services if s.name == service)
    (child,) = children(svc.proc.pid)
    os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while svc.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert svc.proc.returncode == 1, f"'{service}' kept serving after its child {child} died"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run(speech(mesh.conductor_address, TEXTS[:1]), timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
