"""BAGEL served by the in-process mesh (real gRPC on loopback, CPU, the tiny random checkpoint):
text-to-image, editing, understanding and think mode give what the reference gave on the same
checkpoint and noise (data/README.md), in one group, with prefill and generation on two groups
(the contexts' K/V handed over), and with the CFG branches on groups of their own; bad requests
are INVALID_ARGUMENT naming the field; every request's pages are freed."""

import asyncio
import dataclasses
import io
import json

import grpc
import numpy as np
import pytest
import torch

from mstar.config import load_config
from mstar.v1 import conductor_pb2 as cpb

from helpers import collect, run, wait_released
from inprocess import inprocess_mesh

CONFIGS = "models/bagel/configs"


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def pixels(data: bytes) -> torch.Tensor:
    from PIL import Image

    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy())


def scenario_request(meta, name):
    from test_bagel_reference import scenario_image

    s = meta["scenarios"][name]
    k = s["kw"]
    kw = {"mode": "understand" if name == "understand" else ("edit" if name == "edit" else "text_to_image")}
    if name == "understand":
        kw["max_tokens"] = k["max_think_token_n"] - 1
    else:
        kw.update(seed=s["seed"], steps=k["num_timesteps"], timestep_shift=k["timestep_shift"], cfg_text=k["cfg_text_scale"],
                  cfg_img=k["cfg_img_scale"], cfg_interval=k["cfg_interval"], cfg_renorm=k["cfg_renorm_type"])
        if "image_shapes" in k:
            kw["height"], kw["width"] = k["image_shapes"]
    if k.get("think"):
        kw.update(think=True, think_max_tokens=k["max_think_token_n"] - 1)
    files = [cpb.InputFile(name="image", content_type="image/png", data=png(scenario_image(s["image"])))] if s["image"] else []
    return cpb.GenerateRequest(model="bagel", text=s["prompt"], model_kwargs_json=json.dumps(kw), files=files)


def mesh_config(name, meta):
    cfg = load_config(f"{CONFIGS}/{name}.yaml")
    kw = {**cfg.model_kwargs, "vae_image": meta["vae_fit"][:2], "vit_image": meta["vit_fit"][:2]}
    return dataclasses.replace(cfg, model_kwargs=kw)


def check(name, meta, tensors, out):
    s = meta["scenarios"][name]
    if s.get("text") is not None:
        assert "".join(c.text for c in out["text"]) == s["text"]
    if f"{name}.pixels" in tensors:
        (chunk,) = out["image"]
        assert chunk.modality == cpb.MODALITY_IMAGE and chunk.mime_type == "image/png"
        diff = (pixels(chunk.data).int() - tensors[f"{name}.pixels"].int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (name, diff.max())


@pytest.mark.parametrize("config, scenarios", [
    ("default", ("t2i", "edit", "understand", "think")),
    ("disaggregated", ("t2i", "edit", "understand", "think")),
    ("cfg_parallel", ("t2i", "edit")),
    ("cfg_parallel_2gpu", ("edit",)),
])
def test_requests_through_the_mesh_match_the_reference(bagel_cache, reference, config, scenarios):
    tensors, meta = reference

    async def go():
        async with inprocess_mesh(mesh_config(config, meta), cache_dir=bagel_cache) as mesh:
            reqs = [scenario_request(meta, n) for n in scenarios]
            if config == "default":  # ignore_eos: max_tokens tokens decoded whatever is sampled, the text as before
                understand = scenario_request(meta, "understand")
                kw = {**json.loads(understand.model_kwargs_json), "max_tokens": 40, "ignore_eos": True}
                understand.model_kwargs_json = json.dumps(kw)
                reqs.append(understand)
            res = await asyncio.gather(*(collect(mesh.stub, r, timeout=60) for r in reqs))
            for name, (out, final) in zip(scenarios, res, strict=False):
                check(name, meta, tensors, out)
                assert final.usage.prompt_tokens > 0
            if config == "default":
                out, final = res[-1]
                assert final.usage.completion_tokens == 40
                assert "".join(c.text for c in out["text"]).startswith(meta["scenarios"]["understand"]["text"])
            await wait_released(mesh)
            for s in mesh.groups.values():
                for sub in s.runtime.submodules.values():
                    lm = getattr(sub, "lm", None)
                    if lm is not None:
                        assert lm.engine.cache.request_ids() == [] and not lm.contexts
    run(go(), timeout=120)


def test_bad_requests_name_the_field(bagel_cache, reference):
    _, meta = reference
    img = cpb.InputFile(name="image", content_type="image/png", data=scenario_request(meta, "edit").files[0].data)

    def req(kw, files=(), text="a cat"):
        return cpb.GenerateRequest(model="bagel", text=text, model_kwargs_json=json.dumps(kw), files=list(files))

    cases = [
        (req({"height": 1040}), "model_kwargs.height"),
        (req({"width": 72}), "model_kwargs.width"),
        (req({"steps": 101}), "model_kwargs.steps"),
        (req({"steps": 1}), "model_kwargs.steps"),
        (req({"n": 9}), "model_kwargs.n"),
        (req({"cfg_renorm": "local"}), "model_kwargs.cfg_renorm"),
        (req({"cfg_interval": [0.5, 0.2]}), "model_kwargs.cfg_interval"),
        (req({"num_timesteps": 10}), "model_kwargs.num_timesteps"),
        (req({"mode": "paint"}), "model_kwargs.mode"),
        (req({"mode": "edit"}), "files"),
        (req({"mode": "text_to_image"}, [img]), "files"),
        (req({"mode": "understand"}, [cpb.InputFile(name="image", data=b"not an image")]), "files[0].data"),
        (req({}, text=" "), "text"),
    ]

    async def go():
        async with inprocess_mesh(mesh_config("default", meta), cache_dir=bagel_cache) as mesh:
            for r, field in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(mesh.stub, r)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value.details())
                assert e.value.details().startswith(field + ":"), (field, e.value.details())
    run(go(), timeout=60)
