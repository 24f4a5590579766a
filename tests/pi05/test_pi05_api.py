"""π0.5's client-facing API on a served mesh (in-process: real gRPC on loopback, the tiny random
checkpoint, the real gateway app in front of the conductor): Conductor.Act from plain protobuf and
from descriptors fetched by reflection, equal to Generate and to the policy called directly; Act on
Generate's path (admission, timeout, Cancel, metrics, release); the gateway's JSON, raw float32 and
multipart answers; bad input is INVALID_ARGUMENT / 400 naming the field of the request sent."""

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp
import grpc
import numpy as np
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from google.protobuf import descriptor_pool, message_factory
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status
from test_pi05_invariants import too_many_pixels
from test_pi05_mesh import CONFIGS, STATE, act, cameras, direct

from mstar import metrics, wire
from mstar.config import load_config
from mstar.gateway.app import create_app
from mstar.v1 import conductor_pb2 as cpb

from helpers import collect, run, wait_released
from inprocess import inprocess_mesh

STATE32 = np.float32(STATE).tolist()  # what a float32 ActRequest.state carries


def act_request(task="pick up the cube", files=None, state=STATE32, **kw) -> cpb.ActRequest:
    files = cameras(0) if files is None else files
    images = [cpb.CameraImage(name=f.name, data=f.data, mime_type=f.content_type) for f in files]
    return cpb.ActRequest(model="pi05", task=task, images=images, state=state, **kw)


@asynccontextmanager
async def served(cache, **conductor_kw):
    """The mesh and the gateway app in front of its conductor."""
    async with inprocess_mesh(load_config(f"{CONFIGS}/default.yaml"), cache_dir=cache, **conductor_kw) as mesh:
        app = create_app(mesh.address)
        async with TestClient(TestServer(app), timeout=aiohttp.ClientTimeout(total=60)) as http:
            yield mesh, http


def field_of(e: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(e)
    bad = error_details_pb2.BadRequest()
    status.details[0].Unpack(bad)
    return bad.field_violations[0].field


def test_act_equals_generate_and_the_policy(pi05_cache, policy):
    from mstar.models.registry import create_model

    model = create_model("pi05", {}, pi05_cache)
    model.prepare_conductor()
    started = metrics.REQUESTS_STARTED.labels("pi05")._value.get()

    async def go():
        async with served(pi05_cache) as (mesh, _):
            reply = await mesh.stub.Act(act_request(seed=3, request_id="robot-1"), timeout=60)
            out, _ = await collect(mesh.stub, act("pick up the cube", cameras(0), state=STATE32, seed=3), timeout=60)
            unseeded = [await mesh.stub.Act(act_request(), timeout=60) for _ in range(2)]
            await wait_released(mesh)
            return reply, out["actions"][0].tensor, unseeded
    reply, generated, unseeded = run(go(), timeout=120)
    assert reply.request_id == "robot-1"
    assert reply.actions.datatype == "FP32" and list(reply.actions.shape) == [10, 32]
    assert reply.actions.raw == generated.raw  # the same request through Generate: the same bytes
    want = direct(model, policy, "pick up the cube", cameras(0), {"state": STATE32, "seed": 3})
    torch.testing.assert_close(wire.from_proto(reply.actions), want, atol=1e-5, rtol=0)
    assert reply.usage.prompt_tokens > 20 and reply.usage.walks == 2
    assert 0 < reply.timings.process_prompt_s <= reply.timings.first_output_s <= reply.timings.total_s
    assert unseeded[0].actions.raw != unseeded[1].actions.raw  # no seed: fresh noise
    assert metrics.REQUESTS_STARTED.labels("pi05")._value.get() - started == 4  # Act counts as Generate does


def test_act_from_a_client_built_by_reflection(pi05_cache):
    """A client in another language: the descriptors from server reflection, no generated code."""
    def descriptors(address):  # blocking reflection calls: off the loop the server runs on
        with grpc.insecure_channel(address) as ch:
            pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
            method = pool.FindServiceByName("mstar.v1.Conductor").FindMethodByName("Act")
            return method, message_factory.GetMessageClass(method.input_type), \
                message_factory.GetMessageClass(method.output_type)

    async def go():
        async with served(pi05_cache) as (mesh, _):
            method, req_cls, resp_cls = await asyncio.to_thread(descriptors, mesh.address)
            assert not method.server_streaming and not method.client_streaming
            fields = {f.name: f for f in method.input_type.fields}
            assert fields["state"].cpp_type == fields["state"].CPPTYPE_FLOAT and fields["seed"].has_presence
            req = req_cls(model="pi05", task="pick up the cube", state=STATE32, seed=3)
            for f in cameras(0):
                req.images.add(name=f.name, data=f.data, mime_type=f.content_type)
            call = mesh.channel.unary_unary("/mstar.v1.Conductor/Act", request_serializer=req_cls.SerializeToString,
                                            response_deserializer=resp_cls.FromString)
            dynamic = await call(req, timeout=60)
            typed = await mesh.stub.Act(act_request(seed=3), timeout=60)
            return dynamic, typed
    dynamic, typed = run(go(), timeout=120)
    assert dynamic.actions.raw == typed.actions.raw and list(dynamic.actions.shape) == [10, 32]
    actions = np.frombuffer(dynamic.actions.raw, "<f4").reshape(dynamic.actions.shape)
    assert np.isfinite(actions).all() and actions.std() > 0


def test_bad_act_requests_name_the_actrequest_field(pi05_cache):
    good = cameras(0)
    png = good[0].data
    cases = [
        (act_request(state=STATE32[:7]), "state"),  # the robot's state has 8 values
        (act_request(state=[]), "state"),
        (act_request(state=[float("nan")] * 8), "state"),
        (act_request(files=[cpb.InputFile(name="base_0_rgb", data=b"not an image")]), "images[0].data"),
        (act_request(files=[good[0], cpb.InputFile(name="left_wrist_0_rgb", data=png[:40])]), "images[1].data"),
        (act_request(files=[cpb.InputFile(name="base_0_rgb", data=too_many_pixels())]), "images[0].data"),
        (act_request(files=[cpb.InputFile(name=n, data=png) for n in ("base_0_rgb", "left_wrist_0_rgb",
                                                                      "right_wrist_0_rgb", "top_rgb")]), "images"),
        (act_request(files=[cpb.InputFile(name="top_rgb", data=png)]), "images[0].name"),
        (act_request(files=[]), "images"),
        (act_request(seed=2**63), "seed"),
        (act_request(timeout_s=-1), "timeout_s"),
    ]

    async def go():
        async with served(pi05_cache) as (mesh, _):
            out = []
            for req, _ in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await mesh.stub.Act(req, timeout=30)
                out.append(e.value)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mesh.stub.Act(cpb.ActRequest(model="pi0", task="go"), timeout=30)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "Served: pi05" in e.value.details()
            await wait_released(mesh)
            return out
    for (_, field), e in zip(cases, run(go(), timeout=120), strict=True):
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.details())
        assert e.details().startswith(field + ":") and field_of(e) == field, (field, e.details())


def test_act_on_a_model_without_it_names_model():
    async def go():
        async with inprocess_mesh(load_config("models/toy/configs/default.yaml")) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mesh.stub.Act(cpb.ActRequest(model="toy", task="go", state=[1.0]), timeout=30)
            return e.value
    e = run(go(), timeout=60)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and field_of(e) == "model"
    assert "does not serve Act" in e.details() and "call Generate" in e.details()


def test_act_takes_generates_path(pi05_cache, monkeypatch):
    """Admission, the request's timeout and Cancel by request_id apply to Act; each ends released."""
    from mstar.models.pi05 import nodes

    step = nodes.ActionNode.step

    def slow_step(self, inputs, iteration):  # the whole loop runs on a worker thread: the mesh stays live
        if iteration == 0:
            import time

            time.sleep(0.4)
        return step(self, inputs, iteration)
    monkeypatch.setattr(nodes.ActionNode, "step", slow_step)

    async def go():
        async with served(pi05_cache, max_inflight=1) as (mesh, _):
            first = asyncio.ensure_future(mesh.stub.Act(act_request(request_id="a"), timeout=30))
            while not mesh.conductor.table.active:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await mesh.stub.Act(act_request(), timeout=30)
            assert (await mesh.stub.Cancel(cpb.CancelRequest(request_id="a"), timeout=5)).cancelled
            with pytest.raises(grpc.aio.AioRpcError) as cancelled:
                await first
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await mesh.stub.Act(act_request(timeout_s=0.1), timeout=30)
            await wait_released(mesh)
            ok = await mesh.stub.Act(act_request(), timeout=30)
            return full.value, cancelled.value, late.value, ok
    full, cancelled, late, ok = run(go(), timeout=120)
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "admission limit of 1" in full.details()
    assert cancelled.code() == grpc.StatusCode.CANCELLED and "'a' was cancelled" in cancelled.details()
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "timeout of 0.1 s" in late.details()
    assert list(ok.actions.shape) == [10, 32]


def _form(task: str, files, **kwargs) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("model", "pi05")
    form.add_field("text", task)
    form.add_field("model_kwargs", json.dumps(kwargs))
    for f in files:
        form.add_field(f.name, f.data, filename=f"{f.name}.png", content_type=f.content_type)
    return form


def test_gateway_answers_actions_as_json_raw_float32_and_multipart(pi05_cache):
    async def go():
        async with served(pi05_cache) as (mesh, http):
            reply = await mesh.stub.Act(act_request(seed=5), timeout=60)
            async with http.post("/generate", data=_form("pick up the cube", cameras(0), state=STATE32, seed=5)) as r:
                assert r.status == 200, await r.text()
                as_json = await r.json()
            async with http.post("/generate", data=_form("pick up the cube", cameras(0), state=STATE32, seed=5),
                                 headers={"Accept": "application/octet-stream"}) as r:
                assert r.status == 200, await r.text()
                raw, headers = await r.read(), r.headers
            async with http.post("/generate", data=_form("pick up the cube", cameras(0), state=STATE32, seed=5),
                                 headers={"Accept": "multipart/mixed"}) as r:
                assert r.status == 200 and r.content_type == "multipart/mixed"
                reader = aiohttp.MultipartReader.from_response(r)
                parts = []
                while (part := await reader.next()) is not None:
                    parts.append((dict(part.headers), await part.read()))
            return reply, as_json, raw, headers, parts
    reply, as_json, raw, headers, parts = run(go(), timeout=120)
    want = np.frombuffer(reply.actions.raw, "<f4").reshape(10, 32)
    (chunk,) = as_json["outputs"]["actions"]["chunks"]
    assert chunk["datatype"] == "FP32" and chunk["shape"] == [10, 32]
    assert np.array_equal(np.asarray(chunk["values"], np.float32), want)  # JSON numbers, exact float32 values
    assert raw == reply.actions.raw
    assert headers["Content-Type"] == "application/octet-stream" and headers["X-Tensor-Datatype"] == "FP32"
    assert headers["X-Tensor-Shape"] == "10,32" and headers["X-Tensor-Name"] == "actions" and headers["X-Request-Id"]
    (h, body), (fh, final) = parts
    assert h["X-Chunk-Name"] == "actions" and h["X-Chunk-Modality"] == "action" and h["X-Tensor-Shape"] == "10,32"
    assert body == reply.actions.raw and int(h["Content-Length"]) == 10 * 32 * 4
    assert fh["Content-Type"] == "application/json" and json.loads(final)["type"] == "final"


def test_gateway_bad_input_is_a_400_naming_the_field(pi05_cache):
    octet = {"Accept": "application/octet-stream"}
    cases = [
        (_form("go", cameras(0), state=STATE[:7]), octet, "model_kwargs.state"),
        (_form("go", [cpb.InputFile(name="base_0_rgb", data=b"junk", content_type="image/png")], state=STATE), octet,
         "files[0].data"),
        (_form("go", cameras(0, ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")) + cameras(1, ("top_rgb",)),
               state=STATE), {}, "files"),
        (_form("go", cameras(0), state=STATE), {**octet, "X": "1"}, None),  # control: this one is fine
    ]

    async def go():
        async with served(pi05_cache) as (mesh, http):
            out = []
            for form, headers, _ in cases:
                async with http.post("/generate", data=form, headers=headers) as r:
                    out.append((r.status, await r.read()))
            for body, headers in (({"output": "frames"}, octet), ({"output": "actions"}, {}), ({"stream": True}, octet)):
                async with http.post("/generate", json={"model": "pi05", "text": "go", **body}, headers=headers) as r:
                    out.append((r.status, await r.read()))
            return out
    outs = run(go(), timeout=120)
    for (_, _, field), (status, body) in zip(cases, outs, strict=False):
        if field is None:
            assert status == 200 and len(body) == 10 * 32 * 4
            continue
        err = json.loads(body)["error"]
        assert status == 400 and err["field"] == field and err["message"].startswith(field + ":"), (field, body)
    frames, json_output, streamed = (json.loads(b)["error"] for _, b in outs[len(cases):])
    assert frames["field"] == "output" and "no tensor output 'frames'; its tensor outputs: actions" in frames["message"]
    assert json_output["field"] == "output" and "Accept: application/octet-stream" in json_output["message"]
    assert streamed["field"] == "stream" and "multipart/mixed" in streamed["message"]
