"""Node-group replicas: the conductor pins each request to one replica per group, spreads
new requests, takes failed replicas out of rotation and lets new ones join."""

import asyncio

import grpc
import pytest

from mstar.conductor.replicas import NoReplica, Replicas, parse_groups
from mstar.config import Placement
from mstar.models.registry import create_model
from mstar.services.node_group.runtime import NodeGroupRuntime
from mstar.services.node_group.server import NodeGroupServer
from mstar.services.transport import Protocol
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

from helpers import collect, request, rot13, run, text_of, wait_released
from inprocess import inprocess_mesh


def test_pick_spreads_by_load_then_least_recent():
    reps = Replicas({"g": ["a:1", "b:2"]})
    first, second = reps.pick("g"), reps.pick("g")
    assert {first, second} == {"a:1", "b:2"}  # equal load: alternate
    reps.unpin("g", first)
    assert reps.pick("g") == first  # the one with fewer requests in flight
    reps.unpin("g", first)
    reps.unpin("g", second)
    seq = [reps.pick("g") for _ in range(4)]
    for a in seq:
        reps.unpin("g", a)
    assert seq.count("a:1") == seq.count("b:2") == 2


def test_down_left_and_rejoined_replicas():
    reps = Replicas({"g": ["a:1", "b:2"], "h": []})
    reps.mark_down("g", "a:1", "stream broke")
    assert reps.serving("g") == ["b:2"] and {reps.pick("g") for _ in range(3)} == {"b:2"}
    reps.leave("g", "b:2")
    with pytest.raises(NoReplica, match=r"node group 'g' has no healthy replica \(a:1: stream broke; b:2: left"):
        reps.pick("g")
    with pytest.raises(NoReplica, match="node group 'h' has no healthy replica"):
        reps.pick("h")
    reps.join("g", "c:3")
    reps.join("g", "a:1")  # a rejoin puts it back at once
    assert reps.serving("g") == ["a:1", "c:3"]
    with pytest.raises(KeyError):
        reps.join("nope", "x:1")


def test_parse_groups():
    assert parse_groups({"a": "h:1", "b": ["h:2", "h:3"]}) == {"a": ["h:1"], "b": ["h:2", "h:3"]}
    with pytest.raises(ValueError, match="node group 'a' needs 'host:port'"):
        parse_groups({"a": ["nocolon"]})


def test_health_probe_takes_dead_replicas_out_and_back(toy_config):
    async def main():
        async with inprocess_mesh(toy_config(), Protocol.TCP) as mesh:
            reps = mesh.conductor.table.replicas
            live = reps.serving("decoder")[0]
            reps.join("decoder", "127.0.0.1:1")  # nothing listens there
            reps.mark_down("decoder", live, "test")
            await reps.probe_once()
            assert sorted(reps.serving("decoder")) == sorted([live, "127.0.0.1:1"]), "one failed probe is not enough"
            for _ in range(reps.probe_failures - 1):
                await reps.probe_once()
            assert reps.serving("decoder") == [live], "the probe restores the live one and drops the dead one"
            reps.leave("decoder", live)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(mesh.stub, request("abc"))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "node group 'decoder' has no healthy replica" in e.value.details()
            assert not mesh.conductor.table.active
    run(main())


def test_join_rejects_bad_input(toy_config):
    async def main():
        async with inprocess_mesh(toy_config(), Protocol.TCP) as mesh, grpc.aio.insecure_channel(mesh.internal) as ch:
            stub = conductor_pb2_grpc.WalkEventsStub(ch)
            encoder = mesh.conductor.table.replicas.serving("encoder")[0]
            for req, field in ((cpb.JoinRequest(group="nope", address="h:1"), "group"),
                               (cpb.JoinRequest(group="decoder", address="nocolon"), "address"),
                               (cpb.JoinRequest(group="decoder", address=encoder), "address")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Join(req, timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)
            with pytest.raises(grpc.aio.AioRpcError) as e:  # the public port does not serve WalkEvents (issue 30)
                await conductor_pb2_grpc.WalkEventsStub(mesh.channel).Join(cpb.JoinRequest(group="decoder",
                                                                                           address="h:1"), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    run(main())


def test_a_joined_replica_serves_its_share_and_requests_stay_on_their_replicas(toy_config):
    """A second decoder replica (same process: tensors are handed over, AUTO) joins over
    gRPC; requests spread over both and every result is complete and correct."""
    async def main():
        config = toy_config()
        async with inprocess_mesh(config, Protocol.AUTO) as mesh:
            model = create_model(config.model, config.model_kwargs)
            runtime = NodeGroupRuntime("decoder", model, Placement(config, model), {}, mesh.internal, Protocol.AUTO)
            extra = NodeGroupServer("127.0.0.1:0", runtime)
            await extra.start()
            try:
                address = f"127.0.0.1:{extra.port}"
                async with grpc.aio.insecure_channel(mesh.internal) as ch:
                    resp = await conductor_pb2_grpc.WalkEventsStub(ch).Join(
                        cpb.JoinRequest(group="decoder", address=address), timeout=5)
                assert address in resp.replicas and len(resp.replicas) == 2
                prompts = [f"replica {i} says hi" for i in range(6)]
                results = await asyncio.gather(*(collect(mesh.stub, request(p)) for p in prompts))
                for p, (out, final) in zip(prompts, results, strict=True):
                    assert text_of(out["text"]) == rot13(p) and final.usage.completion_tokens == len(p)
                assert runtime.calls > 0 and mesh.runtime("decoder").calls > 0, "both replicas did work"
                await wait_released(mesh)  # a finished request's RELEASE may ride along for a few ms
                deadline = asyncio.get_running_loop().time() + 5
                while runtime.requests and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)
                assert not runtime.requests and not mesh.runtime("decoder").requests, "both released everything"
            finally:
                await extra.stop(grace_s=0.5)
    run(main())


def test_conductor_is_not_ready_until_every_group_has_a_replica(toy_config):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mstar.conductor.requests import RequestTable
    from mstar.conductor.server import ConductorServer

    async def status(port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return r.status

    async def main():
        config = toy_config()
        model = create_model(config.model, config.model_kwargs)
        model.prepare_conductor()
        table = RequestTable(model, Placement(config, model), Replicas({g: [] for g in config.group_names}), Protocol.TCP)
        server = ConductorServer("127.0.0.1:0", table)
        await server.start()
        try:
            assert await status(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
            for g in config.group_names[:-1]:
                table.replicas.join(g, "127.0.0.1:1")
            await asyncio.sleep(0.3)
            assert await status(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING, "one group still has none"
            table.replicas.join(config.group_names[-1], "127.0.0.1:1")
            for _ in range(50):
                if await status(server.port) == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.05)
            assert await status(server.port) == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(grace_s=0.2)
    run(main())
