"""Orpheus with its KV-cache engine in a child process (model_kwargs.engine_process): the
same speech as the engine on the service's thread, pages freed on cancel, refused knob
values named, and a dead engine process takes its service down instead of hanging."""

import asyncio
import os

import pytest
import yaml
from test_orpheus_tp import PCM_TOL, TEXTS, kill_child_and_expect_the_service_down, pcm16, speech

from mstar.config import load_config
from mstar.launcher import LaunchOptions, Mesh
from mstar.models.base import NodeContext
from mstar.models.orpheus.llm_node import use_engine_process
from mstar.services.engines.tensor_parallel import TPSpec
from mstar.v1 import conductor_pb2 as cpb

from helpers import cancel_and_drain, run, wait_released
from inprocess import inprocess_mesh

CONFIGS = "models/orpheus/configs"
pytestmark = pytest.mark.e2e


def config(tmp_path, engine_process) -> str:
    cfg = yaml.safe_load(open(f"{CONFIGS}/disaggregated.yaml"))
    cfg["model_kwargs"].update(snac_noise=False, engine_process=engine_process)
    path = tmp_path / f"ep-{engine_process}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def engine_children(pid: int) -> list[int]:
    kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [int(k) for k in kids if "spawn_main" in open(f"/proc/{k}/cmdline").read()]


async def settled(llm) -> int:
    """KV pages in use once the child has applied every release sent to it."""
    seen = []
    for _ in range(200):
        seen = [*seen[-9:], llm.kv_stats().pages_used]
        if len(seen) == 10 and len(set(seen)) == 1:
            break
        await asyncio.sleep(0.02)
    return seen[-1]


def test_the_knob():
    def ctx(device, v, tp=None):
        return NodeContext("llm", device, None, {} if v is None else {"engine_process": v}, tp)

    assert use_engine_process(ctx("cuda:0", None)) and not use_engine_process(ctx("cpu", None))
    assert not use_engine_process(ctx("cuda:0", None, TPSpec(0, 2, "tcp://x")))  # TP leads from the service
    assert use_engine_process(ctx("cpu", True)) and not use_engine_process(ctx("cuda:0", False))
    for bad, tp in (("yes", None), (True, TPSpec(0, 2, "tcp://x"))):
        with pytest.raises(ValueError, match="model_kwargs.engine_process"):
            use_engine_process(ctx("cpu", bad, tp))


def test_engine_process_speaks_like_the_engine_thread_and_frees_pages(weights, tmp_path):
    async def speak_with(engine_process):
        async with inprocess_mesh(load_config(config(tmp_path, engine_process)), cache_dir=weights) as mesh:
            got = await speech(mesh.address, TEXTS)
            llm = mesh.runtime("llm").submodules["llm"]
            if engine_process:
                child = llm.engine.proc
                assert child.is_alive() and child.pid != os.getpid()
                await wait_released(mesh)
                used0 = await settled(llm)
                call = mesh.stub.Generate(cpb.GenerateRequest(model="orpheus", text="A long one.", request_id="long",
                                                              model_kwargs_json='{"max_tokens": 2000, "seed": 1}'), timeout=60)
                await call.read()  # audio is flowing: the request holds pages in the child
                assert llm.kv_stats().pages_used > used0
                await cancel_and_drain(mesh, call, "long")
                assert await settled(llm) == used0  # the releases reached the child and freed its pages
                driver = mesh.runtime("llm").drivers["llm"]
                assert not llm.engine.has_work and not driver._waiting and not driver._early and not driver._held
            return got, (child if engine_process else None)

    want, _ = run(speak_with(False), timeout=180)
    got, child = run(speak_with(True), timeout=180)
    assert [len(p) for p in got] == [10 * 2048 * 2] * 2 and got[0] != got[1]
    for g, w in zip(got, want, strict=True):
        assert int((pcm16(g) - pcm16(w)).abs().max()) <= PCM_TOL
    child.join(10)
    assert not child.is_alive(), "the engine process outlived its service"


def test_a_dead_engine_process_stops_its_service(weights, tmp_path):
    path = config(tmp_path, True)
    mesh = Mesh(load_config(path), LaunchOptions(path, port=0, grpc_port=0, cache_dir=weights, log_level="WARNING",
                                                 startup_timeout_s=120))
    mesh.start()
    try:
        assert len(run(speech(mesh.conductor_address, TEXTS[:1]), timeout=120)[0]) == 10 * 2048 * 2
        kill_child_and_expect_the_service_down(mesh, "llm", engine_children)
    finally:
        mesh.stop()
