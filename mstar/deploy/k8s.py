"""Kubernetes manifests of a placement: a Deployment and a Service per service of the
topology (node groups request ``nvidia.com/gpu``), a ConfigMap with the placement YAML and
one with the control plane's targets, and a ServiceMonitor (prometheus-operator CRD).

Files: ``mstar.yaml`` (core objects, ``kubectl apply -f``) and ``servicemonitor.yaml``
(apply where prometheus-operator is installed). Two Secrets are made by hand first, never
generated: ``mstar-tls`` (ca.pem, cert.pem, key.pem: the mesh's certificate, mounted by the node
groups, the conductor and the control plane) and ``mstar-api-keys`` (file ``api-keys``, mounted
by the gateway and the conductor).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from mstar.config import PlacementConfig
from mstar.deploy.topology import (
    API_KEYS_PATH,
    CONFIG_PATH,
    METRICS_PORT,
    TARGETS_DIR,
    TLS_DIR,
    Options,
    ServiceSpec,
    Topology,
    build,
    gateway_pods,
)

PREFIX = "mstar-"
PART_OF = {"app.kubernetes.io/part-of": "mstar"}
PLACEMENT_CM, TARGETS_CM = "mstar-placement", "mstar-xds-targets"
TLS_SECRET, API_KEYS_SECRET = "mstar-tls", "mstar-api-keys"  # made by hand, never generated (deploy/README.md)
IMAGE_UID = 10001  # the user deploy/Dockerfile runs as


def _labels(s: ServiceSpec) -> dict:
    return {"app.kubernetes.io/name": s.name, "app.kubernetes.io/component": s.kind.replace("_", "-"), **PART_OF}


def _probe(s: ServiceSpec, **kw) -> dict:
    kind, target = s.probe[:2]
    port = int(target.rsplit(":", 1)[1].split("/", 1)[0])
    if kind == "grpc-mtls":  # Kubernetes' gRPC probe cannot present the mesh's client certificate
        return {"exec": {"command": s.probe_command}, "timeoutSeconds": 5, **kw}
    if kind == "grpc":
        return {"grpc": {"port": port}, **kw}
    return {"httpGet": {"path": "/" + target.split("/", 3)[3], "port": port}, **kw}


def _container_ports(s: ServiceSpec) -> list[dict]:
    """One entry per port number (the gateway serves metrics on its http port)."""
    seen: dict[int, str] = {}
    for name, port in s.ports.items():
        seen.setdefault(port, name)
    return [{"name": name, "containerPort": port} for port, name in seen.items()]


def deployment(s: ServiceSpec, opts: Options) -> dict:
    container: dict = {
        "name": s.kind.replace("_", "-"), "image": opts.image, "command": s.command,
        "ports": _container_ports(s),
        "startupProbe": _probe(s, periodSeconds=5, failureThreshold=120),  # weights may take minutes to load
        "readinessProbe": _probe(s, periodSeconds=5, failureThreshold=2),
        "livenessProbe": _probe(s, periodSeconds=10, failureThreshold=3),
    }
    volumes = []
    if s.kind in ("node_group", "conductor"):
        container["volumeMounts"] = [{"name": "placement", "mountPath": str(Path(CONFIG_PATH).parent), "readOnly": True}]
        volumes = [{"name": "placement", "configMap": {"name": PLACEMENT_CM}}]
    if s.kind == "xds":
        container["volumeMounts"] = [{"name": "targets", "mountPath": TARGETS_DIR, "readOnly": True}]
        volumes = [{"name": "targets", "configMap": {"name": TARGETS_CM}}]
    if s.tls:  # the mesh's certificate: kubectl create secret generic mstar-tls --from-file=DIR (deploy/README.md)
        container.setdefault("volumeMounts", []).append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": TLS_SECRET, "defaultMode": 0o440}})
    if s.api_keys:  # kubectl create secret generic mstar-api-keys --from-file=api-keys=FILE
        container.setdefault("volumeMounts", []).append(
            {"name": "api-keys", "mountPath": str(Path(API_KEYS_PATH).parent), "readOnly": True})
        volumes.append({"name": "api-keys", "secret": {"secretName": API_KEYS_SECRET, "defaultMode": 0o440}})
    if s.devices:
        container["resources"] = {"limits": {"nvidia.com/gpu": len(s.devices)}}
    pod: dict = {"containers": [container], "terminationGracePeriodSeconds": 30}
    if s.tls or s.api_keys:  # the image's user (deploy/Dockerfile, uid 10001) reads the secrets through their group
        pod["securityContext"] = {"fsGroup": IMAGE_UID}
    if volumes:
        pod["volumes"] = volumes
    spec: dict = {"replicas": s.replicas, "selector": {"matchLabels": {"app.kubernetes.io/name": s.name}},
                  "template": {"metadata": {"labels": _labels(s)}, "spec": pod}}
    if s.devices:
        spec["strategy"] = {"type": "Recreate"}  # a new pod cannot get the GPUs before the old one frees them
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": s.name, "labels": _labels(s)},
            "spec": spec}


def service(s: ServiceSpec) -> dict:
    ports = []
    for name, port in s.ports.items():
        exposed = METRICS_PORT if name == "metrics" and port != METRICS_PORT else port  # gateway: metrics on http
        ports.append({"name": name, "port": exposed, "targetPort": port, "protocol": "TCP"})
    spec: dict = {"selector": {"app.kubernetes.io/name": s.name}, "ports": ports}
    if s.kind == "envoy":
        spec["type"] = "LoadBalancer"  # the front door; ClusterIP + port-forward works too
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": s.name, "labels": _labels(s)}, "spec": spec}


def headless(s: ServiceSpec) -> dict:
    """Resolves to every ready gateway pod, so the control plane health-checks each replica."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": gateway_pods(s.name, PREFIX), "labels": {**_labels(s), "app.kubernetes.io/name":
                                                                          gateway_pods(s.name, PREFIX)}},
            "spec": {"clusterIP": "None", "selector": {"app.kubernetes.io/name": s.name},
                     "ports": [{"name": "http", "port": s.ports["http"], "targetPort": s.ports["http"]}]}}


def service_monitor() -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": "mstar", "labels": dict(PART_OF)},
            "spec": {"selector": {"matchLabels": dict(PART_OF)},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"},
                                   {"port": "admin", "path": "/stats/prometheus", "interval": "15s"}]}}


def render(config: PlacementConfig, config_text: str, opts: Options) -> tuple[Topology, list[dict], list[dict]]:
    """The topology, the core objects, and the CRD objects."""
    topo = build(config, opts, prefix=PREFIX)
    objects: list[dict] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": PLACEMENT_CM, "labels": dict(PART_OF)},
         "data": {Path(CONFIG_PATH).name: config_text}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": TARGETS_CM, "labels": dict(PART_OF)},
         "data": {"targets.json": topo.targets_json}},
    ]
    for s in topo.services:
        objects += [deployment(s, opts), service(s)]
        if s.kind == "gateway":
            objects.append(headless(s))
    return topo, objects, [service_monitor()]


def _dump_all(docs: list[dict]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False, width=120)


def write(config: PlacementConfig, config_text: str, out: Path, opts: Options) -> list[Path]:
    _, objects, crds = render(config, config_text, opts)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    header = f"# Generated by `mstar deploy k8s` for model '{config.model}'; regenerate rather than edit.\n"
    files = {"mstar.yaml": header + _dump_all(objects),
             "servicemonitor.yaml": header + "# Needs prometheus-operator (the ServiceMonitor CRD).\n" + _dump_all(crds)}
    for name, text in files.items():
        (out / name).write_text(text)
    return [out / n for n in files]
