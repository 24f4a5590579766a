"""`mstar deploy compose|k8s`: the generated stack's structure, the compose topology run as
local processes, the Kubernetes manifests validated against the Kubernetes schemas, and
the committed examples kept fresh."""

import json
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from compose_local import LocalCompose
from ops_helpers import http, scrape, value, wait_for

from mstar.config import load_config
from mstar.deploy import compose, grafana, k8s
from mstar.deploy.topology import Options
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "models" / "toy" / "configs" / "default.yaml"
MSTAR = ("node-encoder", "node-decoder", "node-audio", "conductor", "gateway", "xds", "envoy")


def deploy(target: str, out: Path, *args: str, config: Path = TOY) -> None:
    r = subprocess.run([sys.executable, "-m", "mstar.cli", "deploy", target, "--config", str(config), "--out", str(out),
                        *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def gpu_config(tmp_path) -> Path:
    """The toy placement with its decoder on the second rank."""
    text = TOY.read_text().replace("    node_names: [decoder, tally, blob_sink]\n    ranks: [0]",
                                   "    node_names: [decoder, tally, blob_sink]\n    ranks: [1]")
    assert "ranks: [1]" in text
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    return path


def test_compose_structure(tmp_path, gpu_config):
    deploy("compose", tmp_path / "gpu", "--gpus", "2,3", "--gateway-replicas", "2", "--node-replicas", "decoder=3",
           config=gpu_config)
    spec = yaml.safe_load((tmp_path / "gpu" / "docker-compose.yml").read_text())
    services = spec["services"]
    assert set(services) == {*MSTAR, "prometheus", "grafana"}
    # only the front door and the observability UIs are published
    published = {n: s["ports"] for n, s in services.items() if "ports" in s}
    assert published == {"envoy": ["10000:10000"], "prometheus": ["9090:9090"], "grafana": ["3000:3000"]}
    healthy = {"condition": "service_healthy"}
    assert services["conductor"]["depends_on"] == {g: healthy for g in MSTAR[:3]}
    assert services["gateway"]["depends_on"] == {"conductor": healthy}
    assert services["envoy"]["depends_on"] == {"xds": healthy}
    for name in MSTAR:
        s = services[name]
        assert s["image"] == "mstar:latest" and s["build"]["dockerfile"] == "deploy/Dockerfile"
        assert s["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "mstar.deploy.probe"], name
    # GPUs: each node group reserves the devices its ranks map to
    for group, device in (("node-encoder", "2"), ("node-decoder", "3"), ("node-audio", "2")):
        (reservation,) = services[group]["deploy"]["resources"]["reservations"]["devices"]
        assert reservation == {"driver": "nvidia", "device_ids": [device], "capabilities": ["gpu"]}
        assert services[group]["command"][services[group]["command"].index("--device") + 1] == "cuda:0"
    assert not any("resources" in services[n].get("deploy", {}) for n in MSTAR[3:])
    assert services["gateway"]["deploy"] == {"replicas": 2}
    # node-group replicas: each joins the conductor by itself, so the conductor is given none
    assert services["node-decoder"]["deploy"]["replicas"] == 3 and "replicas" not in services["node-audio"]["deploy"]
    conductor_cmd = services["conductor"]["command"]
    assert conductor_cmd[conductor_cmd.index("--groups") + 1] == "{}"
    assert "--peers" not in services["node-decoder"]["command"]
    # Prometheus scrapes every service (gateway and node groups by DNS: every replica)
    prom = yaml.safe_load((tmp_path / "gpu" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    static = {t for j in jobs.values() for c in j.get("static_configs", []) for t in c["targets"]}
    assert static == {"conductor:9100", "xds:9100", "envoy:9901"}
    assert jobs["mstar-gateway"]["dns_sd_configs"] == [{"names": ["gateway"], "type": "A", "port": 8000,
                                                         "refresh_interval": "15s"}]
    assert jobs["mstar-node-group"]["dns_sd_configs"] == [{"names": ["node-encoder", "node-decoder", "node-audio"],
                                                            "type": "A", "port": 9100, "refresh_interval": "15s"}]
    assert jobs["mstar-envoy"]["metrics_path"] == "/stats/prometheus"
    # the control plane's targets name every service; Grafana gets the dashboard
    targets = json.loads((tmp_path / "gpu" / "xds" / "targets.json").read_text())
    assert {t["cluster"] for t in targets} == {"gateway", "conductor", "node-encoder", "node-decoder", "node-audio"}
    assert (tmp_path / "gpu" / "grafana" / "dashboards" / "mstar.json").read_text() == grafana.render()
    # without --gpus nothing reserves a GPU
    deploy("compose", tmp_path / "cpu")
    cpu = yaml.safe_load((tmp_path / "cpu" / "docker-compose.yml").read_text())["services"]
    assert not any("deploy" in cpu[n] for n in MSTAR)


def test_compose_topology_runs_as_local_processes(tmp_path):
    pytest.importorskip("envoy.service.discovery.v3.ads_pb2_grpc", reason="the stack's control plane needs xds-protos")
    from mstar.xds.envoy import EnvoyNotFound, envoy_binary

    try:
        envoy_binary()
    except EnvoyNotFound as e:
        pytest.skip(f"the stack's Envoy cannot run here: {e}")
    deploy("compose", tmp_path)
    # the secrets the deploy README has one make: the mesh's certificate and the API keys
    subprocess.run([sys.executable, "-m", "mstar.cli", "tls", "init", str(tmp_path / "secrets" / "tls")], check=True,
                   capture_output=True, timeout=60)
    key = "compose-key-" + "k" * 20
    (tmp_path / "secrets" / "api-keys").write_text(f"{key}\n")
    bearer = {"authorization": f"Bearer {key}"}
    stack = LocalCompose(tmp_path)
    try:
        stack.up(timeout=90)
        envoy = stack.url("envoy", 10000)
        # Envoy is up before the control plane's next poll finds the gateway healthy
        wait_for(lambda: http("GET", f"{envoy}/health", timeout=5)[0] == 200, 20, "a healthy gateway behind Envoy")
        assert http("POST", f"{envoy}/generate", {"model": "toy", "text": "compose"})[0] == 401, "the stack needs a key"
        status, body = http("POST", f"{envoy}/generate", {"model": "toy", "text": "compose"}, headers=bearer)
        assert status == 200 and json.loads(body)["outputs"]["text"]["text"] == "pbzcbfr"
        with grpc.insecure_channel(envoy.removeprefix("http://")) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            responses = list(stub.Generate(cpb.GenerateRequest(model="toy", text="abc"), timeout=20,
                                           metadata=tuple(bearer.items())))
        assert "".join(c.text for r in responses for c in r.chunks if c.name == "text") == "nop"
        # the node groups speak TCP to each other by (mapped) DNS name; metrics on their metrics port
        decoder = scrape(f"{stack.url('node-decoder', 9100)}/metrics")
        assert value(decoder, "mstar_edge_tensors_total", src="decoder", dst="audio", transport="inline") > 0
        conductor = scrape(f"{stack.url('conductor', 9100)}/metrics")
        assert value(conductor, "mstar_requests_finished_total", model="toy") == 2
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.down()


def _containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def test_k8s_manifests_validate_against_the_kubernetes_schemas(tmp_path):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    deploy("k8s", tmp_path, "--gpus", "0", "--gateway-replicas", "2")
    docs = list(yaml.safe_load_all((tmp_path / "mstar.yaml").read_text()))
    version = kv.utils.latest_version()
    for doc in docs:
        kv.validate(doc, version, strict=True)  # raises on any schema violation
    broken = json.loads(json.dumps(docs[2]))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):  # the validator does reject what is wrong
        kv.validate(broken, version, strict=True)
    kinds = [(d["kind"], d["metadata"]["name"]) for d in docs]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    services = [d for d in docs if d["kind"] == "Service"]
    assert set(deployments) == {f"mstar-{n}" for n in MSTAR}
    assert ("ConfigMap", "mstar-placement") in kinds and ("ConfigMap", "mstar-xds-targets") in kinds
    assert yaml.safe_load(docs[0]["data"]["placement.yaml"]) == yaml.safe_load(TOY.read_text())
    for name in ("mstar-node-encoder", "mstar-node-decoder", "mstar-node-audio"):
        assert _containers(deployments[name])[0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert "resources" not in _containers(deployments["mstar-conductor"])[0]
    assert deployments["mstar-gateway"]["spec"]["replicas"] == 2
    # every Service selects a Deployment's pods and targets a port its container declares
    for svc in services:
        (target,) = [d for d in deployments.values()
                     if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        declared = {p["containerPort"] for p in _containers(target)[0]["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= declared, svc["metadata"]["name"]
    # ServiceMonitor: a CRD (its schema ships with prometheus-operator, not with kubernetes-validate),
    # so it is checked against the Services it must find instead
    (monitor,) = yaml.safe_load_all((tmp_path / "servicemonitor.yaml").read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    selected = [s for s in services if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    port_names = {p["name"] for s in selected for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    scraped = {s["metadata"]["name"] for s in selected if {"metrics", "admin"} & {p["name"] for p in s["spec"]["ports"]}}
    assert scraped == {f"mstar-{n}" for n in MSTAR}  # every service once (not the headless gateway-pods)


def test_dashboard_queries_only_defined_metrics():
    from prometheus_client import REGISTRY

    import mstar.metrics  # noqa: F401  (defines every mstar_ metric in the default registry)

    defined = set()
    for family in REGISTRY.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        defined |= {family.name + s for s in suffixes}
    exprs = [t["expr"] for p in grafana.dashboard()["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bmstar_\w+", e)}
    assert len(used) >= 20 and used <= defined, sorted(used - defined)


@pytest.mark.parametrize("target", ["compose", "k8s"])
def test_committed_examples_are_fresh(tmp_path, target):
    """deploy/<target>/toy and deploy/grafana/mstar.json are what the generators write now
    (regenerate: mstar deploy compose|k8s --config models/toy/configs/default.yaml)."""
    config, text = load_config(TOY), TOY.read_text()
    if target == "compose":
        compose.write(config, text, tmp_path, Options(), context="../../..")
    else:
        k8s.write(config, text, tmp_path, Options())
    committed = ROOT / "deploy" / target / "toy"
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    have = {p.relative_to(committed): p.read_text() for p in committed.rglob("*") if p.is_file()}
    assert fresh == have
    assert (ROOT / "deploy" / "grafana" / "mstar.json").read_text() == grafana.render()
