"""Service runtime settings: the node groups' torch.profiler trace (mstar serve --torch-profile; mstar/torch_profile.py) and its
summary (bench/trace_gaps.py): spans of threads that predate the profiler are in the trace, the
spans go back to off when it stops, and the summary attributes the GPU's idle time to the spans
open on the host; MSTAR_TORCH_THREADS."""

import asyncio
import gzip
import json
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mstar import nvtx
from mstar.torch_profile import TorchProfile

from helpers import started_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import trace_gaps  # noqa: E402


def test_profile_records_every_thread_and_restores_spans(tmp_path):
    worker = ThreadPoolExecutor(max_workers=1)
    worker.submit(lambda: None).result()  # the thread exists before the profiler starts, as a node group's do
    assert not nvtx.ACTIVE
    prof = TorchProfile(str(tmp_path), "grp", window_s=5)
    assert prof.stop() is None
    assert prof.start() == 1 and prof.recording and nvtx.ACTIVE

    def forward():
        with nvtx.span("prefill/vit_encoder x1"):
            return torch.ones(64, 64) @ torch.ones(64, 64)
    worker.submit(forward).result()
    with nvtx.span("receive 1 frames from conductor"):
        torch.zeros(3).add_(1)
    rec = prof.stop()
    assert rec is not None and prof.stop() is None and not prof.recording
    assert not nvtx.ACTIVE  # back to what MSTAR_NVTX says (off here)
    files = prof.write(rec)
    stem = f"grp-{os.getpid()}-1"
    assert [f.name for f in files] == [f"{stem}.trace.json.gz", f"{stem}.ops.txt"]
    with gzip.open(files[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    spans = {e["name"]: e["tid"] for e in events if e.get("cat") == "user_annotation"}
    assert {"prefill/vit_encoder x1", "receive 1 frames from conductor"} <= set(spans)
    assert spans["prefill/vit_encoder x1"] != spans["receive 1 frames from conductor"]  # two threads
    assert any(e.get("name") == "aten::mm" and e["tid"] == spans["prefill/vit_encoder x1"] for e in events)
    assert "aten::mm" in files[1].read_text()
    assert not list(tmp_path.glob("*.trace.json"))  # the raw trace is gone once compressed
    worker.shutdown()


def test_sigusr1_starts_and_stops_a_recording(tmp_path, monkeypatch):
    """``arm`` (a node group's, the conductor's): SIGUSR1 starts, the next one stops and writes; a
    recording whose window ends is written without a second signal."""
    from mstar import env
    from mstar.torch_profile import arm

    monkeypatch.setenv("MSTAR_TORCH_PROFILE", str(tmp_path))
    monkeypatch.setenv("MSTAR_TORCH_PROFILE_S", "0.3")
    env.settings.cache_clear()

    async def run():
        loop = asyncio.get_running_loop()
        profile = arm("grp", loop)
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.sleep(0.05)
            assert profile.recording
            torch.ones(8).sum()
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.sleep(0.05)
            assert not profile.recording
            os.kill(os.getpid(), signal.SIGUSR1)  # the second one ends by its window
            for _ in range(200):
                await asyncio.sleep(0.05)
                if len(list(tmp_path.glob("*.ops.txt"))) == 2:
                    break
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
        return profile
    try:
        profile = asyncio.run(run())
    finally:
        env.settings.cache_clear()
    assert not profile.recording and profile.recordings == 2
    assert sorted(p.name for p in tmp_path.glob("*.ops.txt")) == [f"grp-{os.getpid()}-{k}.ops.txt" for k in (1, 2)]


def test_a_recording_still_on_at_the_stop_is_written(tmp_path, monkeypatch):
    """``write_pending`` (a service's stop): the recording SIGUSR1 started is stopped and written;
    with nothing recording, or profiling off, it does nothing."""
    from mstar import env
    from mstar.torch_profile import arm, write_pending

    monkeypatch.setenv("MSTAR_TORCH_PROFILE", str(tmp_path))
    env.settings.cache_clear()

    async def run():
        loop = asyncio.get_running_loop()
        profile = arm("svc", loop)
        try:
            await write_pending(profile, loop)  # nothing on: nothing written
            assert not list(tmp_path.iterdir())
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.sleep(0.05)
            assert profile.recording
            await write_pending(profile, loop)
            assert not profile.recording
            await write_pending(None, loop)  # profiling off
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
    try:
        asyncio.run(run())
    finally:
        env.settings.cache_clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"svc-{os.getpid()}-1.{e}" for e in ("ops.txt", "trace.json.gz")]


def test_stacked_spans_push_both_and_pop_in_reverse():
    calls = []
    nvtx.configure(True, lambda n: calls.append(("a+", n)), lambda: calls.append(("a-",)))
    try:
        push, pop = nvtx.stacked(lambda n: calls.append(("b+", n)), lambda: calls.append(("b-",)))
        nvtx.configure(True, push, pop)
        with nvtx.span("x"):
            pass
    finally:
        nvtx.configure(False)
    assert calls == [("a+", "x"), ("b+", "x"), ("b-",), ("a-",)]


def test_a_span_pops_what_it_pushed_when_ranges_change_meanwhile():
    """A recording starts or ends on the event loop while a forward thread is inside a span: the
    span pops with the pop of its push (ranges turned off meanwhile, or swapped for others)."""
    calls = []
    nvtx.configure(True, lambda n: calls.append(("a+", n)), lambda: calls.append(("a-",)))
    try:
        with nvtx.span("x"):
            nvtx.configure(False)
        nvtx.configure(True, lambda n: calls.append(("a+", n)), lambda: calls.append(("a-",)))
        with nvtx.span("y"):
            nvtx.configure(True, lambda n: calls.append(("b+", n)), lambda: calls.append(("b-",)))
    finally:
        nvtx.configure(False)
    assert calls == [("a+", "x"), ("a-",), ("a+", "y"), ("a-",)]


def test_trace_gaps_refuses_a_trace_without_gpu_work():
    import pytest

    with pytest.raises(SystemExit, match="no GPU events"):
        trace_gaps.summarize([ev("cpu_op", "aten::mm", 0, 5)])


def ev(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_trace_gaps_attributes_idle_time_to_open_spans():
    events = [
        ev("kernel", "k1", 0, 10), ev("kernel", "k2", 12, 8),  # a 2 us gap inside a replay
        ev("kernel", "k3", 100, 10), ev("gpu_memcpy", "d2h", 300, 20),
        ev("user_annotation", "action_gen/expert x1", 0, 25, tid=2),
        ev("user_annotation", "prefill/vit_encoder x2", 50, 60, tid=3),  # open over 20..100's middle
        ev("cpu_op", "aten::copy_", 55, 10, tid=3),
        ev("user_annotation", "receive 1 frames from conductor", 150, 10),  # not open at 110..300's middle
    ]
    out = trace_gaps.summarize(events, top=3)
    assert out["window_ms"] == 320e-3 and out["gpu_busy_ms"] == 48e-3 and out["gpu_idle_ms"] == 272e-3
    assert out["idle_by_span_ms"] == {"no span": 190e-3, "prefill/vit_encoder": 80e-3,
                                      f"gaps under {trace_gaps.SHORT_GAP_US:g} us": 2e-3}
    assert out["spans"]["prefill/vit_encoder"] == {"count": 1, "mean_host_ms": 60e-3, "mean_gpu_busy_ms": 10e-3}
    assert out["spans"]["action_gen/expert"]["mean_gpu_busy_ms"] == 18e-3
    assert out["longest_idle"][0] == {"at_ms": 110e-3, "ms": 190e-3, "spans": [], "cpu_ops": []}
    assert out["longest_idle"][1]["spans"] == ["prefill/vit_encoder x2"]
    assert out["longest_idle"][1]["cpu_ops"] == ["aten::copy_"]


def test_torch_threads_setting(monkeypatch):
    """MSTAR_TORCH_THREADS over a service's default; a bad value is refused by name."""
    import pytest

    from mstar import env

    before = torch.get_num_threads()
    try:
        for value, default, want in (("", 1, 1), ("3", 1, 3), ("", None, before), ("2", None, 2)):
            torch.set_num_threads(before)
            monkeypatch.setenv("MSTAR_TORCH_THREADS", value)
            env.settings.cache_clear()
            env.apply_torch_threads(default)
            assert torch.get_num_threads() == want, (value, default)
        for bad in ("0", "-1", "two"):
            monkeypatch.setenv("MSTAR_TORCH_THREADS", bad)
            env.settings.cache_clear()
            with pytest.raises(ValueError, match="MSTAR_TORCH_THREADS"):
                env.settings()
    finally:
        torch.set_num_threads(before)
        monkeypatch.delenv("MSTAR_TORCH_THREADS")
        env.settings.cache_clear()


def test_a_served_mesh_records_its_node_groups_and_conductor(tmp_path, toy_config, monkeypatch):
    """``mstar serve --torch-profile`` end to end on the toy mesh (real processes): ``record_around``
    signals every node group and the conductor around three requests; each writes its trace, and
    the conductor's holds its spans (a request read, its first walk, frame batches in)."""
    import gzip
    import json
    from pathlib import Path

    import grpc

    from mstar.launcher import LaunchOptions, Mesh
    from mstar.torch_profile import record_around
    from mstar.v1 import conductor_pb2 as cpb
    from mstar.v1 import conductor_pb2_grpc

    monkeypatch.setenv("MSTAR_TORCH_PROFILE_S", "600")  # the signals end the recording, not a window
    config = Path(__file__).resolve().parent.parent / "models" / "toy" / "configs" / "default.yaml"
    mesh = started_mesh(lambda: Mesh(toy_config(), LaunchOptions(config, port=0, grpc_port=0, log_level="WARNING",
                                                                  torch_profile=str(tmp_path))))
    try:
        def requests() -> int:
            async def go():
                async with grpc.aio.insecure_channel(mesh.conductor_address) as ch:
                    stub = conductor_pb2_grpc.ConductorStub(ch)
                    for _ in range(3):
                        async for _ in stub.Generate(cpb.GenerateRequest(model="toy", text="hi"), timeout=30):
                            pass
                return 3
            return asyncio.run(asyncio.wait_for(go(), 60))

        pids = mesh.profiled_pids()
        assert sorted(pids) == ["audio", "conductor", "decoder", "encoder"]
        done, files = record_around(list(pids.values()), tmp_path, requests, timeout_s=120)
    finally:
        mesh.stop()
    assert done == 3
    assert sorted(f for f in files if f.endswith(".ops.txt")) == sorted(f"{n}-{p}-1.ops.txt" for n, p in pids.items())
    events = json.load(gzip.open(tmp_path / f"conductor-{pids['conductor']}-1.trace.json.gz"))["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert {"conductor: read request", "conductor: first walk", "conductor: frames in"} <= names
