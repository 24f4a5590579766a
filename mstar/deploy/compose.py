"""docker-compose stack of a placement: a container per service of the topology, plus
Prometheus (scraping all of them) and Grafana (the M* dashboard provisioned).

Files written to the output directory::

    docker-compose.yml   placement.yaml   xds/targets.json   prometheus.yml
    grafana/provisioning/{datasources,dashboards}/*.yml   grafana/dashboards/mstar.json
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from mstar.config import PlacementConfig
from mstar.deploy import grafana
from mstar.deploy.topology import (
    API_KEYS_PATH,
    CONFIG_PATH,
    ENVOY_PORT,
    TARGETS_DIR,
    TLS_DIR,
    Options,
    ServiceSpec,
    Topology,
    build,
)

PROMETHEUS_IMAGE = "prom/prometheus:v2.55.1"
GRAFANA_IMAGE = "grafana/grafana:11.3.0"
#: how long a node group may take to load its weights before failed health checks count
NODE_START_PERIOD = "300s"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _healthcheck(s: ServiceSpec) -> dict:
    start = NODE_START_PERIOD if s.kind == "node_group" else "30s"
    return {"test": ["CMD", *s.probe_command], "interval": "5s", "timeout": "3s", "retries": 3, "start_period": start}


def _service(s: ServiceSpec, opts: Options, build_context: str | None) -> dict:
    out: dict = {"image": opts.image}
    if build_context is not None:
        out["build"] = {"context": build_context, "dockerfile": "deploy/Dockerfile"}
    out["command"] = s.command
    out["expose"] = sorted({str(p) for p in s.ports.values()})
    if s.kind in ("node_group", "conductor"):
        out["volumes"] = [f"./placement.yaml:{CONFIG_PATH}:ro"]
    if s.kind == "xds":
        out["volumes"] = [f"./xds:{TARGETS_DIR}:ro"]
    if s.tls:  # the mesh's certificate (`mstar tls init secrets/tls`; never committed)
        out.setdefault("volumes", []).append(f"./secrets/tls:{TLS_DIR}:ro")
    if s.api_keys:  # one API key per line (an empty file: no keys, the API is open)
        out.setdefault("volumes", []).append(f"./secrets/api-keys:{API_KEYS_PATH}:ro")
    if s.kind == "envoy":
        out["ports"] = [f"{ENVOY_PORT}:{ENVOY_PORT}"]
    if s.depends_on:
        out["depends_on"] = {d: {"condition": "service_healthy"} for d in s.depends_on}
    out["healthcheck"] = _healthcheck(s)
    if s.kind == "gateway":
        out["stop_grace_period"] = "15s"  # drain delay + in-flight responses
    deploy: dict = {}
    if s.replicas != 1:
        deploy["replicas"] = s.replicas
    if s.devices:
        deploy["resources"] = {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": [str(d) for d in s.devices], "capabilities": ["gpu"]}]}}
    if deploy:
        out["deploy"] = deploy
    out["restart"] = "unless-stopped"
    return out


def prometheus_config(topo: Topology) -> dict:
    jobs = []
    for kind in ("gateway", "conductor", "node_group", "xds", "envoy"):
        specs = topo.by_kind(kind)
        job: dict = {"job_name": f"mstar-{kind.replace('_', '-')}", "metrics_path": specs[0].metrics_path}
        if kind in ("gateway", "node_group"):  # every replica: the service name resolves to all of them
            job["dns_sd_configs"] = [{"names": [s.name for s in specs], "type": "A", "port": specs[0].ports["metrics"],
                                      "refresh_interval": "15s"}]
        else:
            port = "admin" if kind == "envoy" else "metrics"
            job["static_configs"] = [{"targets": [f"{s.name}:{s.ports[port]}" for s in specs]}]
        jobs.append(job)
    return {"global": {"scrape_interval": "5s", "evaluation_interval": "15s"}, "scrape_configs": jobs}


def render(config: PlacementConfig, opts: Options, build_context: str | None = None) -> tuple[Topology, dict]:
    topo = build(config, opts)
    services = {s.name: _service(s, opts, build_context) for s in topo.services}
    services["prometheus"] = {
        "image": PROMETHEUS_IMAGE, "volumes": ["./prometheus.yml:/etc/prometheus/prometheus.yml:ro"],
        "ports": ["9090:9090"], "depends_on": {s.name: {"condition": "service_started"} for s in topo.services},
        "restart": "unless-stopped"}
    services["grafana"] = {
        "image": GRAFANA_IMAGE, "ports": ["3000:3000"],
        "environment": {"GF_AUTH_ANONYMOUS_ENABLED": "true", "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
                        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": "/var/lib/grafana/dashboards/mstar.json"},
        "volumes": ["./grafana/provisioning:/etc/grafana/provisioning:ro",
                    "./grafana/dashboards:/var/lib/grafana/dashboards:ro"],
        "depends_on": {"prometheus": {"condition": "service_started"}}, "restart": "unless-stopped"}
    return topo, {"name": f"mstar-{config.model}", "services": services}


GRAFANA_DATASOURCE = {"apiVersion": 1, "datasources": [{
    "name": "Prometheus", "type": "prometheus", "uid": grafana.DATASOURCE["uid"], "access": "proxy",
    "url": "http://prometheus:9090", "isDefault": True}]}
GRAFANA_DASHBOARDS = {"apiVersion": 1, "providers": [{
    "name": "mstar", "type": "file", "disableDeletion": True, "options": {"path": "/var/lib/grafana/dashboards"}}]}


def _dump(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=120)


def build_context(out: Path) -> str | None:
    """The repository root relative to ``out``, when this is a checkout (it has deploy/Dockerfile)."""
    if not (REPO_ROOT / "deploy" / "Dockerfile").exists():
        return None
    return os.path.relpath(REPO_ROOT, Path(out).resolve())


def write(config: PlacementConfig, config_text: str, out: Path, opts: Options, context: str | None = None) -> list[Path]:
    """Write the stack; returns the files written. ``context``: the image's build context
    relative to ``out`` (default: this checkout's root, if it is one)."""
    out = Path(out)
    topo, compose = render(config, opts, context or build_context(out))
    header = (f"# Generated by `mstar deploy compose` for model '{config.model}'; regenerate rather than edit.\n"
              "# First, in this directory: mstar tls init secrets/tls  and write API keys, one per line, to secrets/api-keys\n"
              "# (deploy/README.md, Security). Then: docker compose up -d --build   (Envoy :10000, Prometheus :9090, "
              "Grafana :3000)\n")
    files = {
        "docker-compose.yml": header + _dump(compose),
        "placement.yaml": config_text,
        "xds/targets.json": topo.targets_json,
        "prometheus.yml": _dump(prometheus_config(topo)),
        "grafana/provisioning/datasources/prometheus.yml": _dump(GRAFANA_DATASOURCE),
        "grafana/provisioning/dashboards/mstar.yml": _dump(GRAFANA_DASHBOARDS),
        "grafana/dashboards/mstar.json": grafana.render(),
    }
    written = []
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
