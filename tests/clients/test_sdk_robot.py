"""The SDK's robot calls against real meshes (``mstar serve pi05|vjepa2 --random-weights``), over both
transports, sync and asyncio: ``act`` (gRPC: Conductor.Act; REST: /generate answered as raw float32),
``encode``, ``rollout``, ``rollout_stream`` and ``plan`` as numpy arrays, the same whichever transport
carried them; bad input raises InvalidArgument naming the field of the request sent."""

import asyncio
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from clients_mesh import served

from mstar import AsyncMStarClient, InvalidArgument, MStarClient
from mstar.client import Plan, Rollout, RolloutStep

pytestmark = pytest.mark.e2e
WAIT_S = 60.0
TRANSPORTS = ("rest", "grpc")
STATE = [0.1, -0.3, 0.7, 0.0, 1.2, -1.1, 0.4, 0.25]  # the tiny checkpoint's robot has 8 state values


def png(seed: int, shape=(48, 64, 3)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pi05(tmp_path_factory):
    with served("pi05", "--random-weights", "--cache-dir", str(tmp_path_factory.mktemp("pi05"))) as m:
        yield m


@pytest.fixture(scope="module")
def vjepa2(tmp_path_factory):
    with served("vjepa2", "--random-weights", "--cache-dir", str(tmp_path_factory.mktemp("vjepa2"))) as m:
        yield m


def _address(mesh, transport: str) -> str:
    return mesh.url if transport == "rest" else mesh.grpc_url


def test_act_returns_the_action_chunk_on_both_transports(pi05, tmp_path):
    cam = tmp_path / "base.png"
    cam.write_bytes(png(0))
    images = {"base_0_rgb": cam, "left_wrist_0_rgb": png(1)}  # a path and bytes
    got = {}
    for transport in TRANSPORTS:
        with MStarClient(_address(pi05, transport), timeout=WAIT_S) as client:
            got[transport] = client.act("pick up the cube", images=images, state=STATE, seed=3)
            again = client.act("pick up the cube", images=images, state=STATE, seed=3, model="pi05")
            other = client.act("pick up the cube", images=images, state=STATE, seed=4)
        assert got[transport].dtype == np.float32 and got[transport].shape == (10, 32)
        assert np.array_equal(again, got[transport]) and not np.allclose(other, got[transport], atol=1e-3)
        assert got[transport].flags.writeable
    assert np.array_equal(got["rest"], got["grpc"])

    async def go(transport):
        async with AsyncMStarClient(_address(pi05, transport), timeout=WAIT_S) as client:
            return await client.act("pick up the cube", images=images, state=np.float32(STATE), seed=3)
    for transport in TRANSPORTS:
        assert np.array_equal(asyncio.run(asyncio.wait_for(go(transport), WAIT_S)), got["grpc"])


@pytest.mark.parametrize("transport, state_field, image_field", [("grpc", "state", "images[0].data"),
                                                                  ("rest", "model_kwargs.state", "files[0].data")])
def test_act_errors_name_the_field_of_the_request_sent(pi05, transport, state_field, image_field):
    with MStarClient(_address(pi05, transport), timeout=WAIT_S) as client:
        with pytest.raises(InvalidArgument) as e:
            client.act("go", images={"base_0_rgb": png(0)}, state=STATE[:7])
        assert e.value.field == state_field and "this robot's state has 8" in str(e.value)
        with pytest.raises(InvalidArgument) as e:
            client.act("go", images={"base_0_rgb": b"not a png"}, state=STATE)
        assert e.value.field == image_field and "not a decodable image" in str(e.value)
        with pytest.raises(InvalidArgument) as e:  # caught by the SDK: nothing sent
            client.act("go", images={"base_0_rgb": png(0)}, state=[[1.0, 2.0]])
        assert e.value.field == "state"


FRAMES = (np.random.default_rng(1).random((2, 40, 40, 3)) * 255).astype(np.uint8)
ACTIONS = [[0.01, 0.0, -0.02, 0.0, 0.0, 0.1, 0.5]] * 3
STATES = [[0.0] * 7]


@pytest.fixture(scope="module")
def world(vjepa2):
    """Every V-JEPA 2 call once per transport (the meshes answer deterministically)."""
    out = {}
    for transport in TRANSPORTS:
        with MStarClient(_address(vjepa2, transport), timeout=WAIT_S) as client:
            steps = list(client.rollout_stream(FRAMES[:1], ACTIONS, STATES))
            out[transport] = dict(
                encode=client.encode(FRAMES), rollout=client.rollout(FRAMES[:1], ACTIONS, STATES), steps=steps,
                plan=client.plan(FRAMES[0], FRAMES[1], STATES[0], samples=8, topk=2, cem_steps=2, seed=7))
    return out


def test_world_model_calls_return_numpy_arrays(world):
    for transport in TRANSPORTS:
        w = world[transport]
        assert w["encode"].shape == (16, 64) and w["encode"].dtype == np.float32  # 32 px / patch 8: 4x4 tokens
        r = w["rollout"]
        assert isinstance(r, Rollout) and r.frames.shape == (3, 16, 64) and r.poses.shape == (3, 7)
        assert [s.index for s in w["steps"]] == [0, 1, 2] and all(isinstance(s, RolloutStep) for s in w["steps"])
        assert np.array_equal(np.stack([s.frame for s in w["steps"]]), r.frames)
        assert np.array_equal(np.stack([s.pose for s in w["steps"]]), r.poses)
        p = w["plan"]
        assert isinstance(p, Plan) and p.actions.shape == (2, 7) and p.energies.shape == (2,)
        grip = p.actions[:, -1]
        assert not p.actions[:, 3:6].any() and ((grip == 0) | (np.abs(grip) >= 0.25)).all()  # as the reference ends
    rest, grpc_ = world["rest"], world["grpc"]
    assert np.array_equal(rest["encode"], grpc_["encode"]) and np.array_equal(rest["rollout"].frames, grpc_["rollout"].frames)
    assert np.array_equal(rest["plan"].actions, grpc_["plan"].actions)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_async_world_calls_and_an_early_stop(vjepa2, world, transport, tmp_path):
    clip = tmp_path / "clip.npy"
    np.save(clip, FRAMES)

    async def go():
        async with AsyncMStarClient(_address(vjepa2, transport), timeout=WAIT_S) as client:
            latents = await client.encode(clip)  # a path to raw frames
            steps = [s async for s in await client.rollout_stream(FRAMES[:1], ACTIONS, STATES)]
            stream = await client.rollout_stream(FRAMES[:1], ACTIONS * 2, STATES)
            first = await anext(stream)
            await stream.aclose()  # leaving early cancels the request
            rollout = await client.rollout(FRAMES[:1], ACTIONS, STATES)
            return latents, steps, first, rollout
    latents, steps, first, rollout = asyncio.run(asyncio.wait_for(go(), WAIT_S))
    assert np.array_equal(latents, world["grpc"]["encode"])
    assert np.array_equal(np.stack([s.frame for s in steps]), world["grpc"]["rollout"].frames)
    assert first.index == 0 and first.frame.shape == (16, 64)
    assert np.array_equal(rollout.poses, world["grpc"]["rollout"].poses)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_world_model_errors_name_the_field(vjepa2, transport):
    with MStarClient(_address(vjepa2, transport), timeout=WAIT_S) as client:
        with pytest.raises(InvalidArgument) as e:
            client.encode(b"\x00not a video" * 40)
        assert e.value.field == "files[0]"
        with pytest.raises(InvalidArgument) as e:  # 2 context frames need 1 action between them + 1 a step
            client.rollout(FRAMES, ACTIONS[:1], STATES * 2)
        assert e.value.field == "model_kwargs.actions"
        with pytest.raises(InvalidArgument) as e:  # caught by the SDK
            client.rollout(FRAMES[:1], [a[:6] for a in ACTIONS], STATES)
        assert e.value.field == "actions" and "got shape [3, 6]" in str(e.value)
        with pytest.raises(InvalidArgument) as e:
            client.plan(FRAMES[0], FRAMES[1], STATES[0], samples=4, topk=8)
        assert e.value.field == "model_kwargs.topk"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_robot_example_runs_against_both_models(pi05, vjepa2, transport):
    example = Path(__file__).resolve().parents[2] / "examples" / "robot_example.py"
    out = {}
    for name, mesh in (("pi05", pi05), ("vjepa2", vjepa2)):
        proc = subprocess.run([sys.executable, str(example), "--url", _address(mesh, transport)], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out[name] = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert out["pi05"] == {"model": "pi05", "actions": "float32 [10, 32]", "error": "InvalidArgument field=" +
                           ("state" if transport == "grpc" else "model_kwargs.state")}
    w = out["vjepa2"]
    assert w["model"] == "vjepa2" and w["latents"] == "[16, 64]" and w["rollout"] == "[4, 16, 64] [4, 7]"
    assert [k for k in w if k.startswith("step")] == [f"step {i}" for i in range(4)]
    assert w["plan"] == "[2, 7] energies [4]"
