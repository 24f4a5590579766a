"""V-JEPA 2's client-facing answers through the real gateway app in front of an in-process mesh:
latents as raw bytes with datatype and shape in the headers (equal to the gRPC tensors), a rollout's
frames streamed as multipart parts, bad input a 400 naming the field; and the conductor decodes
video on a worker thread, not on the event loop that routes every request."""

import asyncio
import json
import threading
import time
from contextlib import asynccontextmanager

import aiohttp
import grpc
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_vjepa2_served import npy, ref, req, served  # noqa: F401 (ref, served: fixtures)

from mstar.gateway.app import create_app
from mstar.v1 import conductor_pb2 as cpb

from helpers import collect, forbid_video_decoding, run
from inprocess import inprocess_mesh

OCTET = {"Accept": "application/octet-stream"}


@asynccontextmanager
async def gateway_mesh(cfg):
    async with inprocess_mesh(cfg) as mesh:
        async with TestClient(TestServer(create_app(mesh.address)), timeout=aiohttp.ClientTimeout(total=60)) as http:
            yield mesh, http


def form(files: list[cpb.InputFile], **kwargs) -> aiohttp.FormData:
    f = aiohttp.FormData()
    f.add_field("model", "vjepa2")
    f.add_field("model_kwargs", json.dumps(kwargs))
    for file in files:
        f.add_field(file.name, file.data, filename=file.name, content_type=file.content_type)
    return f


def rollout_inputs(outputs):
    """The reference's first context frames, actions and states as a rollout request."""
    images, acts, states = outputs["images"], outputs["actions"][0], outputs["states"][0]
    return [npy(images[:2].numpy())], dict(task="rollout", actions=acts[:7].tolist(), states=states[:2].tolist())


def test_latents_and_rollouts_leave_the_gateway_as_raw_bytes(served, ref):  # noqa: F811
    cfg, _ = served
    clip = [npy(np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32))]
    files, kw = rollout_inputs(ref)

    async def go():
        async with gateway_mesh(cfg) as (mesh, http):
            grpc_enc, _ = await collect(mesh.stub, req(clip), timeout=60)
            grpc_roll, _ = await collect(mesh.stub, req(files, **kw), timeout=60)
            out = {}
            for name, data, headers in (("latents", form(clip), OCTET), ("json", form(clip), {}),
                                        ("frames", form(files, **kw), OCTET), ("poses", form(files, **kw), OCTET),
                                        ("either", form(files, **kw), OCTET)):
                if name in ("frames", "poses"):
                    data.add_field("output", name)
                async with http.post("/generate", data=data, headers=headers) as r:
                    out[name] = (r.status, dict(r.headers), await r.read())
            return grpc_enc, grpc_roll, out
    grpc_enc, grpc_roll, out = run(go(), timeout=120)
    status, headers, body = out["latents"]
    t = grpc_enc["latents"][0].tensor
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    assert (headers["X-Tensor-Name"], headers["X-Tensor-Datatype"], headers["X-Tensor-Shape"]) == ("latents", "FP32", "32,48")
    assert body == t.raw and list(t.shape) == [32, 48]
    (chunk,) = json.loads(out["json"][2])["outputs"]["latents"]["chunks"]
    assert "values" not in chunk and chunk["shape"] == [32, 48]  # latents stay bytes in JSON too (base64)
    for name, shape in (("frames", "6,9,32"), ("poses", "6,7")):
        status, headers, body = out[name]
        assert status == 200 and headers["X-Tensor-Shape"] == shape, (name, headers)
        assert body == grpc_roll[name][0].tensor.raw
    status, _, body = out["either"]
    err = json.loads(body)["error"]
    assert status == 400 and err["field"] == "output" and "2 tensor outputs (frames, poses)" in err["message"]


def test_a_streamed_rollout_arrives_as_multipart_parts(served, ref):  # noqa: F811
    cfg, _ = served
    files, kw = rollout_inputs(ref)
    kw["stream"] = True

    async def go():
        async with gateway_mesh(cfg) as (mesh, http):
            streamed, _ = await collect(mesh.stub, req(files, **kw), timeout=60)
            async with http.post("/generate", data=form(files, **kw), headers={"Accept": "multipart/mixed"}) as r:
                assert r.status == 200, await r.text()
                reader = aiohttp.MultipartReader.from_response(r)
                parts = []
                while (part := await reader.next()) is not None:
                    parts.append((dict(part.headers), await part.read()))
            return streamed, parts
    streamed, parts = run(go(), timeout=120)
    *chunks, (final_headers, final) = parts
    assert final_headers["X-Chunk-Name"] == "final" and json.loads(final)["usage"]["walks"] == 1
    frames = [(h, b) for h, b in chunks if h["X-Chunk-Name"] == "frames"]
    poses = [(h, b) for h, b in chunks if h["X-Chunk-Name"] == "poses"]
    assert len(frames) == len(poses) == 6 and len(chunks) == 12
    for i, ((h, body), (_, pose)) in enumerate(zip(frames, poses, strict=True)):
        assert h["X-Chunk-Index"] == str(i) and h["X-Tensor-Shape"] == "1,9,32" and h["X-Tensor-Datatype"] == "FP32"
        assert h["Content-Type"] == "application/octet-stream" and h["X-Chunk-Modality"] == "latent"
        assert body == streamed["frames"][i].tensor.raw and pose == streamed["poses"][i].tensor.raw


def test_bad_input_through_the_gateway_names_the_field(served, ref):  # noqa: F811
    cfg, _ = served
    files, kw = rollout_inputs(ref)
    cases = [
        (form([cpb.InputFile(name="clip.mp4", content_type="video/mp4", data=b"\x00not a video" * 50)]), "files[0]"),
        (form(files, **{**kw, "actions": [r[:6] for r in kw["actions"]]}), "model_kwargs.actions"),
        (form([npy(np.zeros((33, 3, 12, 12), np.float32))], task="rollout", actions=[[0.0] * 7] * 40,
              states=[[0.0] * 7] * 33), "files[0]"),
    ]

    async def go():
        async with gateway_mesh(cfg) as (_, http):
            out = []
            for data, _ in cases:
                async with http.post("/generate", data=data, headers=OCTET) as r:
                    out.append((r.status, await r.json()))
            return out
    for (_, field), (status, body) in zip(cases, run(go(), timeout=120), strict=True):
        assert status == 400 and body["error"]["field"] == field, (field, body)
        assert body["error"]["message"].startswith(field + ":")


def test_video_decoding_runs_off_the_conductors_event_loop(served, monkeypatch):  # noqa: F811
    """A decode that takes 0.6 s leaves the conductor answering other calls meanwhile; the toy's
    light read stays on the loop (no worker pool)."""
    from mstar.config import load_config
    from mstar.models.vjepa2 import media

    cfg, _ = served
    threads = []
    load = media.load_frames

    def slow_load(*a, **kw):
        threads.append(threading.current_thread())
        time.sleep(0.6)
        return load(*a, **kw)
    monkeypatch.setattr(media, "load_frames", slow_load)
    clip = [npy(np.zeros((2, 3, 16, 16), np.float32))]

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            assert mesh.conductor.servicer.prompt_pool is not None
            call = asyncio.ensure_future(collect(mesh.stub, req(clip), timeout=30))
            while not threads:
                await asyncio.sleep(0.005)
            gaps = []
            while not call.done():
                t = time.perf_counter()
                await mesh.stub.ListModels(cpb.ListModelsRequest(), timeout=5)
                gaps.append(time.perf_counter() - t)
                await asyncio.sleep(0.01)
            out, _ = await call
            loop_thread = threading.current_thread()
        async with inprocess_mesh(load_config("models/toy/configs/default.yaml")) as toy:
            assert toy.conductor.servicer.prompt_pool is None
        return out, gaps, loop_thread
    out, gaps, loop_thread = run(go(), timeout=60)
    assert list(out["latents"][0].tensor.shape) == [16, 48]
    assert threads and all(t is not loop_thread for t in threads)
    assert len(gaps) >= 5 and max(gaps) < 0.3, gaps  # the loop answered all along the decode


def test_a_decode_failure_in_the_worker_is_invalid_argument(served):  # noqa: F811
    cfg, _ = served

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(mesh.stub, req([cpb.InputFile(name="x.webm", content_type="video/webm", data=b"\x1a" * 99)]))
            return e.value
    e = run(go(), timeout=60)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("files[0]:")


def test_a_frame_size_past_the_limit_is_refused_from_the_header(monkeypatch):
    """An image or video whose header declares frames larger than ``Limits.max_pixels`` is refused
    before any frame is decoded (a small file can declare a huge frame)."""
    import io

    from PIL import Image

    from mstar.models.base import InputFile, InvalidArgument
    from mstar.models.vjepa2 import media

    buf = io.BytesIO()
    Image.new("RGB", (40, 30)).save(buf, format="PNG")
    forbid_video_decoding(monkeypatch)
    with pytest.raises(InvalidArgument, match=r"frames of 40x30 exceed 1000 pixels") as e:
        media.load_frames(InputFile("cam.png", "image/png", buf.getvalue()), "files[0]", 16, 16,
                          limits=media.Limits(max_pixels=1000))
    assert e.value.field == "files[0]"


def test_the_pixels_a_video_decodes_to_are_bounded():
    import io

    from PIL import Image

    from mstar.models.base import InputFile, InvalidArgument
    from mstar.models.vjepa2 import media

    buf = io.BytesIO()
    Image.new("RGB", (40, 30)).save(buf, format="PNG")
    f = InputFile("cam.png", "image/png", buf.getvalue())
    with pytest.raises(InvalidArgument, match=r"the video decodes to more than 1199 pixels in all"):
        media.load_frames(f, "files[0]", 16, 16, limits=media.Limits(max_decoded_pixels=1199))
    assert media.load_frames(f, "files[0]", 16, 16, limits=media.Limits(max_decoded_pixels=1200)).shape[0] == 1
