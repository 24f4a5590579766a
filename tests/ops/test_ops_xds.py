"""The control plane without Envoy: a fake ADS client on a real gRPC stream, and the
targets/health poll that builds the snapshot."""

import asyncio
import json

import grpc
import pytest

from helpers import run

pytest.importorskip("envoy.service.discovery.v3.ads_pb2_grpc", reason="xds-protos is not installed")

from envoy.config.cluster.v3 import cluster_pb2  # noqa: E402
from envoy.config.endpoint.v3 import endpoint_pb2  # noqa: E402
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2  # noqa: E402

from mstar.xds.ads import AdsServicer, Snapshot  # noqa: E402
from mstar.xds.health import HealthChecker  # noqa: E402
from mstar.xds.resources import CLUSTER, ENDPOINT, ProxySettings, build  # noqa: E402
from mstar.xds.server import ControlPlane  # noqa: E402
from mstar.xds.targets import Endpoint, TargetsError, TargetSource, parse_targets  # noqa: E402

GW = Endpoint("gateway", "127.0.0.1", 8000, "http")
GW2 = Endpoint("gateway", "127.0.0.1", 8001, "http")
CD = Endpoint("conductor", "127.0.0.1", 50051, "grpc")


def unpack(resp: discovery_pb2.DiscoveryResponse, cls):
    out = {}
    for a in resp.resources:
        m = cls()
        a.Unpack(m)
        out[getattr(m, "name", "") or m.cluster_name] = m
    return out


def test_ads_state_of_the_world_protocol():
    async def go():
        snapshot = Snapshot()
        snapshot.update(build({GW: True, CD: True}, ProxySettings()))
        server = grpc.aio.server()
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(AdsServicer(snapshot), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        requests: asyncio.Queue = asyncio.Queue()

        async def outgoing():
            while (r := await requests.get()) is not None:
                yield r

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch).StreamAggregatedResources(outgoing())

                replies: asyncio.Queue = asyncio.Queue()

                async def pump():  # timing out a read would cancel the call: read in a task of its own
                    async for r in call:
                        replies.put_nowait(r)

                reader = asyncio.get_running_loop().create_task(pump())

                async def reply(timeout=2.0):
                    return await asyncio.wait_for(replies.get(), timeout)

                requests.put_nowait(discovery_pb2.DiscoveryRequest(type_url=CLUSTER))
                cds = await reply()
                assert set(unpack(cds, cluster_pb2.Cluster)) == {"gateway", "conductor", "gateway-generate",
                                                                  "conductor-generate"}
                requests.put_nowait(discovery_pb2.DiscoveryRequest(type_url=ENDPOINT, resource_names=["gateway"]))
                eds = await reply()
                cla = unpack(eds, endpoint_pb2.ClusterLoadAssignment)
                assert list(cla) == ["gateway"]  # only what was asked for
                # ACKs are answered with nothing
                requests.put_nowait(discovery_pb2.DiscoveryRequest(type_url=CLUSTER, version_info=cds.version_info,
                                                                   response_nonce=cds.nonce))
                requests.put_nowait(discovery_pb2.DiscoveryRequest(type_url=ENDPOINT, resource_names=["gateway"],
                                                                   version_info=eds.version_info, response_nonce=eds.nonce))
                with pytest.raises(asyncio.TimeoutError):
                    await reply(timeout=0.3)
                # a health change pushes EDS (and only EDS: the clusters did not change)
                assert snapshot.update(build({GW: True, GW2: False, CD: True}, ProxySettings())) == [ENDPOINT]
                pushed = await reply()
                assert pushed.type_url == ENDPOINT and pushed.version_info != eds.version_info
                eps = unpack(pushed, endpoint_pb2.ClusterLoadAssignment)["gateway"].endpoints[0].lb_endpoints
                health = {e.endpoint.address.socket_address.port_value: e.health_status for e in eps}
                assert health == {8000: 1, 8001: 2}  # HEALTHY, UNHEALTHY
                # a NACK is logged, not answered with the same thing again
                requests.put_nowait(discovery_pb2.DiscoveryRequest(
                    type_url=ENDPOINT, resource_names=["gateway"], version_info=eds.version_info,
                    response_nonce=pushed.nonce, error_detail={"code": 3, "message": "bad"}))
                with pytest.raises(asyncio.TimeoutError):
                    await reply(timeout=0.3)
                requests.put_nowait(None)
                await asyncio.wait_for(reader, 5)
        finally:
            await server.stop(0)

    run(go(), timeout=20)


def test_targets_are_validated_and_reread_on_change(tmp_path):
    with pytest.raises(TargetsError, match="address must be host:port"):
        parse_targets([{"cluster": "gateway", "address": "nowhere"}], "t.json")
    with pytest.raises(TargetsError, match="health must be one of"):
        parse_targets([{"cluster": "gateway", "address": "a:1", "health": "tcp"}], "t.json")
    (tmp_path / "a.json").write_text(json.dumps([{"cluster": "gateway", "address": "localhost:1", "health": "http"}]))
    source = TargetSource(tmp_path)
    assert [t.port for t in source.read()] == [1]
    (tmp_path / "b.json").write_text(json.dumps([{"cluster": "conductor", "address": "127.0.0.1:2"}]))
    assert [(t.cluster, t.port) for t in source.read()] == [("conductor", 2), ("gateway", 1)]
    (tmp_path / "a.json").unlink()
    assert [t.cluster for t in source.read()] == ["conductor"]


def test_poll_marks_a_dead_endpoint_unhealthy(tmp_path):
    """Nothing listens on the targets' ports: every endpoint is published, UNHEALTHY."""
    import socket

    with socket.socket() as s1, socket.socket() as s2:
        s1.bind(("127.0.0.1", 0))
        s2.bind(("127.0.0.1", 0))
        ports = [s1.getsockname()[1], s2.getsockname()[1]]
        (tmp_path / "t.json").write_text(json.dumps([
            {"cluster": "gateway", "address": f"localhost:{ports[0]}", "health": "http"},
            {"cluster": "conductor", "address": f"127.0.0.1:{ports[1]}", "health": "grpc"}]))

        async def go():
            plane = ControlPlane(TargetSource(tmp_path), ProxySettings(), HealthChecker(timeout_s=0.5))
            try:
                changed = await plane.poll_once()
            finally:
                await plane.checker.close()
            assert set(changed) == {CLUSTER, ENDPOINT, "type.googleapis.com/envoy.config.listener.v3.Listener",
                                    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"}
            assert {(e.cluster, e.port) for e in plane.health} >= {("gateway", ports[0]), ("conductor", ports[1])}
            assert not any(plane.health.values())

        run(go(), timeout=20)
