"""V-JEPA 2 served through the in-process mesh (real gRPC on loopback): encode, predict, rollout,
rollout_streaming and plan give what the modules give when called directly (and the rollout what
the reference computed); bad inputs are INVALID_ARGUMENT naming the field."""

import io
import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from mstar import wire
from mstar.config import parse_config
from mstar.models.vjepa2 import cem, media, rollout, weights
from mstar.v1 import conductor_pb2 as cpb

from helpers import collect, run
from inprocess import inprocess_mesh

DATA = Path(__file__).resolve().parent / "data"  # this folder's reference outputs

P, E = 9, 32


def npy(arr: np.ndarray, name="frames.npy") -> cpb.InputFile:
    buf = io.BytesIO()
    np.save(buf, arr)
    return cpb.InputFile(name=name, content_type="application/x-npy", data=buf.getvalue())


def req(files, **kwargs) -> cpb.GenerateRequest:
    return cpb.GenerateRequest(model="vjepa2", files=files, model_kwargs_json=json.dumps(kwargs))


@pytest.fixture(scope="module")
def ref():
    from safetensors.torch import load_file

    return load_file(str(DATA / "ac_reference.safetensors"))


@pytest.fixture(scope="module")
def served(hf_model, ac_checkpoint):
    _, hf_dir = hf_model
    kwargs = {"checkpoint": str(hf_dir), "ac_checkpoint": str(ac_checkpoint.parent), "dtype": "float32"}
    cfg = parse_config({"model": "vjepa2", "model_kwargs": kwargs,
                        "node_groups": [{"name": "g", "node_names": ["video_encoder", "predictor", "ac_predictor"]}]})
    enc, pred, _ = weights.build(weights.read(hf_dir))
    ac_enc, _, ac = weights.build(weights.read(ac_checkpoint))
    return cfg, (enc, pred, ac_enc, ac)


def mesh_call(cfg, *requests):
    async def go():
        async with inprocess_mesh(cfg) as mesh:
            out = []
            for r in requests:
                try:
                    out.append((await collect(mesh.stub, r, timeout=60))[0])
                except grpc.aio.AioRpcError as e:
                    out.append(e)
            return out
    return run(go(), timeout=120)


def tensor(chunks, i=0):
    return wire.from_proto(chunks[i].tensor)


def test_encode_predict_rollout_stream_and_plan_match_the_modules(served, ref):
    cfg, (enc, pred, ac_enc, ac) = served
    g = torch.Generator().manual_seed(5)
    clip = torch.randn(4, 3, 16, 16, generator=g)
    video_u8 = (torch.rand(4, 20, 24, 3, generator=g) * 255).to(torch.uint8).numpy()  # resized and cropped on the conductor
    acts, states, images = ref["actions"][0], ref["states"][0], ref["images"]
    plan_kw = dict(task="plan", states=states[:1].tolist(), samples=16, topk=4, cem_steps=3, seed=7)
    outs = mesh_call(
        cfg,
        req([npy(clip.numpy())]),
        req([npy(video_u8)]),
        req([npy(clip.numpy())], task="predict", target_ids=[3, 17, 30]),
        req([npy(images[:2].numpy())], task="rollout", actions=acts[:7].tolist(), states=states[:2].tolist()),
        req([npy(images[:2].numpy())], task="rollout", stream=True, actions=acts[:7].tolist(), states=states[:2].tolist()),
        req([npy(images[:1].numpy()), npy(images[3:].numpy(), "goal.npy")], **plan_kw),
    )
    for o in outs:
        assert not isinstance(o, Exception), o
    enc_out, u8_out, pred_out, roll, stream, plan = outs
    with torch.no_grad():
        tokens = enc(clip.unsqueeze(0).transpose(1, 2))[0]
        torch.testing.assert_close(tensor(enc_out["latents"]), tokens, atol=1e-6, rtol=0)
        u8 = media.normalize(media.resize_crop(torch.from_numpy(video_u8), 18, 16), "cpu", torch.float32)
        torch.testing.assert_close(tensor(u8_out["latents"]), enc(u8.unsqueeze(0).transpose(1, 2))[0], atol=1e-6, rtol=0)
        tgt = torch.tensor([3, 17, 30])
        ctx = torch.tensor([i for i in range(32) if i not in (3, 17, 30)])
        want = pred(tokens[ctx][None], ctx[None], tgt[None])[0]
        torch.testing.assert_close(tensor(pred_out["predicted"]), want, atol=1e-6, rtol=0)

    # rollout: one chunk at the loop's end; streaming: one per step; both the reference's frames
    frames, poses = tensor(roll["frames"]), tensor(roll["poses"])
    assert frames.shape == (6, P, E) and poses.shape == (6, 7)
    torch.testing.assert_close(frames, ref["rollout_frames"], atol=1e-4, rtol=0)
    torch.testing.assert_close(poses, ref["rollout_poses"], atol=1e-6, rtol=0)
    assert len(stream["frames"]) == 6 and len(stream["poses"]) == 6
    torch.testing.assert_close(torch.cat([tensor(stream["frames"], i) for i in range(6)]), frames, atol=0, rtol=0)
    torch.testing.assert_close(torch.cat([tensor(stream["poses"], i) for i in range(6)]), poses, atol=0, rtol=0)

    # plan: the same draws (seed 7) through the direct CEM give the same trajectory
    with torch.no_grad():
        reps = rollout.normalize(ac_enc(images.unsqueeze(2)))
    goal = reps[3]

    def world_model(a):
        with torch.no_grad():
            f, _ = rollout.rollout(ac, reps[:1].unsqueeze(0).expand(a.shape[0], -1, -1, -1), a,
                                   states[:1].unsqueeze(0).expand(a.shape[0], -1, -1))
        return f[:, -1]

    cfg_cem = cem.CEMConfig(samples=16, topk=4, cem_steps=3)
    want = cem.plan(cfg_cem, world_model, goal, generator=torch.Generator().manual_seed(7))
    assert plan["action"][0].modality == cpb.MODALITY_ACTION
    torch.testing.assert_close(tensor(plan["action"]), want, atol=1e-6, rtol=0)
    assert tensor(plan["energies"]).shape == (4,)


@pytest.mark.parametrize("fmt, codec, mime", [("mp4", "mpeg4", "video/mp4"), ("webm", "libvpx-vp9", "video/webm")])
def test_a_video_file_decodes_on_the_conductor(served, fmt, codec, mime):
    av = pytest.importorskip("av", reason="PyAV writes the mp4 this test sends (the vjepa2 extra)")
    cfg, (enc, *_) = served
    buf = io.BytesIO()
    rgb = (np.random.default_rng(0).random((4, 32, 48, 3)) * 255).astype(np.uint8)
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
        for f in rgb:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    data = buf.getvalue()
    # typed by name, and as a REST form part arrives: named by its field, application/octet-stream
    got, untyped = mesh_call(cfg, req([cpb.InputFile(name=f"clip.{fmt}", content_type=mime, data=data)]),
                             req([cpb.InputFile(name="video", content_type="application/octet-stream", data=data)]))
    assert not isinstance(got, Exception) and not isinstance(untyped, Exception), (got, untyped)
    assert torch.equal(tensor(got["latents"]), tensor(untyped["latents"]))
    frames = media.load_frames(media.InputFile(f"clip.{fmt}", mime, data), "files[0]", 16, 18)
    assert frames.shape == (4, 16, 16, 3)
    with torch.no_grad():
        want = enc(media.normalize(frames, "cpu", torch.float32).unsqueeze(0).transpose(1, 2))[0]
    torch.testing.assert_close(tensor(got["latents"]), want, atol=1e-6, rtol=0)


def test_bad_inputs_are_invalid_argument_naming_the_field(served, ref):
    cfg, _ = served
    images, acts, states = ref["images"], ref["actions"][0], ref["states"][0]
    two = [npy(images[:2].numpy())]
    cases = [
        (req(two, task="rollout", actions=[r[:6] for r in acts[:7].tolist()], states=states[:2].tolist()),
         "model_kwargs.actions"),  # 6 numbers an action
        (req(two, task="rollout", actions=acts[:1].tolist(), states=states[:2].tolist()), "model_kwargs.actions"),
        (req(two, task="rollout", actions=acts[:7].tolist(), states=states[:1].tolist()), "model_kwargs.states"),
        (req([npy(np.zeros((33, 3, 12, 12), np.float32))], task="rollout", actions=[[0.0] * 7] * 40,
             states=[[0.0] * 7] * 33), "files[0]"),  # too many frames
        (req([npy(np.zeros((66, 3, 16, 16), np.float32))]), "files[0]"),
        (req([npy(np.zeros((3, 3, 16, 16), np.float32))]), "files[0]"),  # not whole tubelets
        (req([cpb.InputFile(name="clip.mp4", content_type="video/mp4", data=b"\x00not a video" * 50)]), "files[0]"),
        (req([npy(np.zeros((2, 3, 8, 8), np.float32))]), "files[0]"),  # float frames at the wrong size
        (req([]), "files"),
        (req(two, task="fly"), "model_kwargs.task"),
        (req([npy(images[:1].numpy())], task="plan", states=states[:1].tolist(), samples=4, topk=8), "model_kwargs.topk"),
        (req([npy(images[:1].numpy())], task="plan", states=states[:1].tolist()), "files"),  # no goal image
    ]
    outs = mesh_call(cfg, *(r for r, _ in cases))
    for (_, field), e in zip(cases, outs, strict=True):
        assert isinstance(e, grpc.aio.AioRpcError), (field, e)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e)
        assert e.details().startswith(field + ":"), (field, e.details())


def test_random_weights_serve_every_task_and_missing_checkpoints_say_where(tmp_path):
    """``mstar serve vjepa2 --random-weights``: the tiny checkpoints written in both layouts load;
    without them the launcher's check names what is missing."""
    from mstar.models.base import MissingAssets
    from mstar.models.registry import create_model

    with pytest.raises(MissingAssets, match="checkpoint 'facebook/vjepa2-vitl-fpc64-256' not found"):
        create_model("vjepa2", {}, str(tmp_path)).check_assets()
    written = create_model("vjepa2", {}, str(tmp_path)).write_random_weights(str(tmp_path))
    assert len(written) == 2
    model = create_model("vjepa2", {}, str(tmp_path))
    model.check_assets()
    cfgs = model.configs()
    assert cfgs["checkpoint"].predictor is not None and cfgs["ac_checkpoint"].ac is not None
    cfg = parse_config({"model": "vjepa2", "node_groups": [{"name": "g", "node_names": ["video_encoder", "predictor",
                                                                                          "ac_predictor"]}]})
    frames = (np.random.default_rng(1).random((2, 40, 40, 3)) * 255).astype(np.uint8)
    untyped = lambda arr: cpb.InputFile(name="frames", content_type="application/octet-stream",  # noqa: E731
                                        data=npy(arr).data)

    async def go():
        async with inprocess_mesh(cfg, cache_dir=str(tmp_path)) as mesh:
            enc, _ = await collect(mesh.stub, req([npy(frames)]))
            pred, _ = await collect(mesh.stub, req([untyped(frames)], task="predict", target_ids=[0, 5]))
            roll, _ = await collect(mesh.stub, req([npy(frames[:1])], task="rollout", actions=[[0.01] * 7] * 3,
                                                   states=[[0.0] * 7]))
            plan, _ = await collect(mesh.stub, req([npy(frames[:1]), npy(frames[1:])], task="plan",
                                                   states=[[0.0] * 7], samples=8, topk=2, cem_steps=2))
            return enc, pred, roll, plan
    enc, pred, roll, plan = run(go(), timeout=120)
    assert tensor(enc["latents"]).shape == (16, 64)  # 32 px / patch 8 -> 4x4 tokens, one tubelet
    assert tensor(pred["predicted"]).shape == (2, 64)
    assert tensor(roll["frames"]).shape == (3, 16, 64) and tensor(roll["poses"]).shape == (3, 7)
    assert tensor(plan["action"]).shape == (2, 7)


def test_concurrent_rollouts_batch_and_each_gets_its_own(served, ref, monkeypatch):
    """Rollouts of different lengths and contexts in flight together (batched steps, each request
    at its own frame) give what each gives alone."""
    import asyncio

    sizes = []
    advance_many = rollout.advance_many

    def counting(pred, rs, actions):
        sizes.append(len(rs))
        return advance_many(pred, rs, actions)
    monkeypatch.setattr(rollout, "advance_many", counting)

    cfg, (_, _, ac_enc, ac) = served
    images, acts, states = ref["images"], ref["actions"][0], ref["states"][0]
    specs = [(1, 3), (2, 5), (3, 2), (1, 6)]  # (context frames, steps)
    reqs = [req([npy(images[:T].numpy())], task="rollout", stream=(i % 2 == 1), actions=acts[:T - 1 + H].tolist(),
                states=states[:T].tolist()) for i, (T, H) in enumerate(specs)]

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            return await asyncio.gather(*(collect(mesh.stub, r, timeout=60) for r in reqs))
    outs = run(go(), timeout=120)
    assert max(sizes) > 1, sizes  # steps of several requests ran as one batch
    with torch.no_grad():
        reps = rollout.normalize(ac_enc(images.unsqueeze(2)))
        for (T, H), (out, _) in zip(specs, outs, strict=True):
            frames, poses = rollout.rollout(ac, reps[:T].unsqueeze(0), acts[:T - 1 + H].unsqueeze(0), states[:T].unsqueeze(0))
            got = torch.cat([tensor(out["frames"], i) for i in range(len(out["frames"]))])
            torch.testing.assert_close(got, frames[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.cat([tensor(out["poses"], i) for i in range(len(out["poses"]))]), poses[0],
                                       atol=0, rtol=0)
