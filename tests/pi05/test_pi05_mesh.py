"""π0.5 served by the in-process mesh (real gRPC on loopback, CPU, the tiny random checkpoint), with
the vision encoder beside the policy and on its own node group: the actions equal the direct model
call, and bad requests are INVALID_ARGUMENT naming the field."""

import asyncio
import io
import json

import grpc
import numpy as np
import pytest
import torch

from mstar import wire
from mstar.config import load_config
from mstar.models.base import InputFile, Prompt
from mstar.models.pi05.policy import pixels_from_uint8
from mstar.v1 import conductor_pb2 as cpb

from helpers import collect, run, wait_released
from inprocess import inprocess_mesh

CONFIGS = "models/pi05/configs"


def png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def cameras(seed: int, names=("base_0_rgb", "left_wrist_0_rgb")) -> list[InputFile]:
    rng = np.random.default_rng(seed)
    shapes = [(56, 56, 3), (40, 70, 3), (64, 48, 3)]  # non-square ones are resized with padding
    return [InputFile(n, "image/png", png(rng.integers(0, 256, shapes[i], dtype=np.uint8))) for i, n in enumerate(names)]


def act(task, files, **kw):
    return cpb.GenerateRequest(model="pi05", text=task, model_kwargs_json=json.dumps(kw),
                               files=[cpb.InputFile(name=f.name, content_type=f.content_type, data=f.data) for f in files])


def direct(model, policy, task, files, kw):
    """The same request through the model's own conductor code and the policy, no runtime."""
    state = model.process_prompt(Prompt(task, files, model.validate_kwargs(kw)))
    p = state.data["prefill"]
    noise = model.noise(kw["seed"])[None]
    x = policy.sample_actions(pixels_from_uint8(p["images"][None], torch.float32), p["image_mask"][None],
                              p["tokens"][None], p["token_mask"][None], noise)
    return model.unnormalize(x[0])


STATE = [0.1, -0.3, 0.7, 0.0, 1.2, -1.1, 0.4, 0.25]


@pytest.mark.parametrize("config", ["default", "vision_split"])
def test_actions_through_the_mesh_equal_the_direct_call(pi05_cache, policy, config):
    from mstar.models.registry import create_model

    model = create_model("pi05", {}, pi05_cache)
    model.prepare_conductor()
    reqs = [("pick up the cube", cameras(0), {"state": STATE, "seed": 3}),
            ("open_the drawer", cameras(1, ("left_wrist_0_rgb", "right_wrist_0_rgb", "base_0_rgb")),
             {"state": STATE[::-1], "seed": 4})]

    async def go():
        async with inprocess_mesh(load_config(f"{CONFIGS}/{config}.yaml"), cache_dir=pi05_cache) as mesh:
            res = await asyncio.gather(*(collect(mesh.stub, act(t, f, **kw), timeout=60) for t, f, kw in reqs))
            for (task, files, kw), (out, final) in zip(reqs, res, strict=True):
                (chunk,) = out["actions"]
                assert chunk.modality == cpb.MODALITY_ACTION
                got = wire.from_proto(chunk.tensor)
                assert got.shape == (10, 32) and got.dtype == torch.float32
                torch.testing.assert_close(got, direct(model, policy, task, files, kw), atol=1e-5, rtol=0)
                assert final.usage.prompt_tokens > 20
            a, b = (wire.from_proto(o["actions"][0].tensor) for o, _ in res)
            assert not torch.allclose(a, b, atol=1e-2)
            loops = next(s.runtime.nodes.whole_loops.loops for s in mesh.groups.values()
                         if "action_expert" in s.runtime.submodules)[("action_gen", "action_expert")]
            assert loops.stats.eager_runs >= 1  # every Euler step of a batch in one call (eager on a CPU)
            await wait_released(mesh)
    run(go(), timeout=120)


def test_bad_requests_name_the_field(pi05_cache):
    good = cameras(0)
    cases = [
        (act("go", good, state=[0.1] * 7), "model_kwargs.state"),
        (act("go", good), "model_kwargs.state"),
        (act("go", good, state=STATE, speed=2), "model_kwargs.speed"),
        (act("go", [InputFile("base_0_rgb", "image/png", b"not an image")], state=STATE), "files[0].data"),
        (act("go", [InputFile("top_rgb", "image/png", good[0].data)], state=STATE), "files[0].name"),
        (act("go", [good[0], InputFile("base_0_rgb", "image/png", good[0].data)], state=STATE), "files[1].name"),
        (act("go", [InputFile(n, "image/png", good[0].data) for n in ("base_0_rgb", "left_wrist_0_rgb",
                                                                       "right_wrist_0_rgb", "extra")], state=STATE), "files"),
        (act("go", [], state=STATE), "files"),
    ]

    async def go():
        async with inprocess_mesh(load_config(f"{CONFIGS}/default.yaml"), cache_dir=pi05_cache) as mesh:
            for req, field in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(mesh.stub, req)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value.details())
                assert e.value.details().startswith(field + ":"), (field, e.value.details())
    run(go(), timeout=60)
