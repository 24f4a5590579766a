"""The services of a placement as containers: one per node group, the conductor, the gateway,
the xDS control plane and Envoy. ``compose.py`` and ``k8s.py`` render the same topology.

Inside a container every service binds fixed ports on 0.0.0.0 and names its peers by DNS
name (compose service or Kubernetes Service). Node-group replicas (one container or pod
each) join the conductor with their own IP; the conductor pins each request to one replica
per group and tells every replica where the others are. Tensors pick their transport per
edge (AUTO): between containers that is inline bytes, or Mooncake where installed.

Trust boundaries: the conductor's public port (Conductor) is what the gateway and Envoy reach;
its internal port (WalkEvents) and the node groups' ports serve mutual TLS with the mesh
certificate mounted at ``TLS_DIR`` (a secret: ``mstar tls init``), which the node groups, the
conductor and the control plane (its health checks) present. The gateway and the conductor
require the API keys mounted at ``API_KEYS_PATH`` (an empty file leaves the API open).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mstar.config import PlacementConfig

CONFIG_PATH = "/etc/mstar/placement.yaml"
TARGETS_DIR = "/etc/mstar/xds"  # a directory: a file dropped in registers more targets
TLS_DIR = "/etc/mstar/tls"  # ca.pem, cert.pem, key.pem: the mesh's certificate (mstar.tls)
API_KEYS_PATH = "/etc/mstar/keys/api-keys"  # one API key per line (mstar.auth)
NODE_PORT = 7000
CONDUCTOR_PORT = 50051  # public: Conductor (gateway, Envoy, clients)
CONDUCTOR_INTERNAL_PORT = 50052  # internal: WalkEvents (node groups), mutual TLS
GATEWAY_PORT = 8000
METRICS_PORT = 9100
XDS_PORT = 18000
ENVOY_PORT = 10000
ENVOY_ADMIN_PORT = 9901
#: the gateway answers /health with 503 this long after SIGTERM, before it closes: > 2 polls
DRAIN_DELAY_S = 5.0
XDS_POLL_S = 2.0


@dataclass
class Options:
    image: str = "mstar:latest"
    gpus: tuple[int, ...] | None = None  # device ids YAML ranks map onto; None: CPU only
    gateway_replicas: int = 1
    node_replicas: dict[str, int] = field(default_factory=dict)  # node group -> replicas (default 1)
    max_inflight: int = 256
    request_timeout_s: float = 300.0
    log_level: str = "INFO"


@dataclass
class ServiceSpec:
    name: str  # DNS name
    kind: str  # node_group | conductor | gateway | xds | envoy
    command: list[str]
    ports: dict[str, int]  # port name -> container port
    #: ("grpc", "127.0.0.1:port"), ("grpc-mtls", "127.0.0.1:port", TLS_DIR) or ("http", "http://127.0.0.1:port/path")
    probe: tuple[str, ...]
    depends_on: list[str] = field(default_factory=list)
    devices: list[int] = field(default_factory=list)  # GPU device ids to reserve
    replicas: int = 1
    group: str | None = None
    metrics_path: str = "/metrics"
    tls: bool = False  # mounts the mesh's certificate (TLS_DIR)
    api_keys: bool = False  # mounts the API keys (API_KEYS_PATH)

    @property
    def probe_command(self) -> list[str]:
        return ["python", "-m", "mstar.deploy.probe", *self.probe]


@dataclass
class Topology:
    config: PlacementConfig
    services: list[ServiceSpec]
    targets: list[dict]  # what the control plane watches (mstar.xds.targets)

    def by_kind(self, kind: str) -> list[ServiceSpec]:
        return [s for s in self.services if s.kind == kind]

    @property
    def targets_json(self) -> str:
        return json.dumps(self.targets, indent=2) + "\n"


def build(config: PlacementConfig, opts: Options, prefix: str = "") -> Topology:
    """``prefix`` goes before every DNS name (Kubernetes: ``mstar-``)."""
    lvl = ["--log-level", opts.log_level]
    tls, keys = ["--tls-dir", TLS_DIR], ["--api-keys-file", API_KEYS_PATH]
    node = {g.name: f"{prefix}node-{dns_label(g.name)}" for g in config.node_groups}
    if len(set(node.values())) != len(node):
        raise ValueError(f"node group names {sorted(node)} collide as DNS names {sorted(node.values())}; rename one")
    unknown = set(opts.node_replicas) - set(node)
    if unknown:
        raise ValueError(f"--node-replicas names unknown node group(s) {sorted(unknown)}; groups: {', '.join(node)}")
    conductor, gateway, xds = f"{prefix}conductor", f"{prefix}gateway", f"{prefix}xds"
    metrics = ["--metrics-port", str(METRICS_PORT)]
    services = []
    for g in config.node_groups:
        devices = [opts.gpus[r] for r in g.ranks] if opts.gpus is not None else []
        services.append(ServiceSpec(
            node[g.name], "node_group",
            ["python", "-m", "mstar.services.node_group", "--config", CONFIG_PATH, "--group", g.name,
             "--address", f"0.0.0.0:{NODE_PORT}", "--conductor", f"{conductor}:{CONDUCTOR_INTERNAL_PORT}", *tls,
             "--device", "cuda:0" if devices else "cpu", *metrics, *lvl],
            {"grpc": NODE_PORT, "metrics": METRICS_PORT}, ("grpc-mtls", f"127.0.0.1:{NODE_PORT}", TLS_DIR),
            devices=devices, group=g.name, replicas=opts.node_replicas.get(g.name, 1), tls=True))
    services.append(ServiceSpec(
        conductor, "conductor",
        ["python", "-m", "mstar.conductor", "--config", CONFIG_PATH, "--address", f"0.0.0.0:{CONDUCTOR_PORT}",
         "--internal-address", f"0.0.0.0:{CONDUCTOR_INTERNAL_PORT}", *tls, *keys,
         "--groups", "{}", "--max-inflight", str(opts.max_inflight),
         "--request-timeout", f"{opts.request_timeout_s:g}", *metrics, *lvl],
        {"grpc": CONDUCTOR_PORT, "internal": CONDUCTOR_INTERNAL_PORT, "metrics": METRICS_PORT},
        ("grpc", f"127.0.0.1:{CONDUCTOR_PORT}"), depends_on=list(node.values()), tls=True, api_keys=True))
    services.append(ServiceSpec(
        gateway, "gateway",
        ["python", "-m", "mstar.gateway", "--conductor", f"{conductor}:{CONDUCTOR_PORT}", "--host", "0.0.0.0",
         "--port", str(GATEWAY_PORT), "--request-timeout", f"{opts.request_timeout_s:g}",
         "--drain-delay", f"{DRAIN_DELAY_S:g}", *keys, *lvl],
        {"http": GATEWAY_PORT, "metrics": GATEWAY_PORT}, ("http", f"http://127.0.0.1:{GATEWAY_PORT}/health"),
        depends_on=[conductor], replicas=opts.gateway_replicas, api_keys=True))
    services.append(ServiceSpec(
        xds, "xds",
        ["python", "-m", "mstar.xds", "--address", f"0.0.0.0:{XDS_PORT}", "--targets", TARGETS_DIR,
         "--listen", f"0.0.0.0:{ENVOY_PORT}", "--poll-interval", f"{XDS_POLL_S:g}",
         "--request-timeout", f"{opts.request_timeout_s:g}", "--max-generate", str(opts.max_inflight), *tls, *metrics,
         *lvl],
        {"grpc": XDS_PORT, "metrics": METRICS_PORT}, ("grpc", f"127.0.0.1:{XDS_PORT}"), tls=True))
    services.append(ServiceSpec(
        f"{prefix}envoy", "envoy",
        ["python", "-m", "mstar.xds.envoy", "--xds", f"{xds}:{XDS_PORT}", "--admin", f"0.0.0.0:{ENVOY_ADMIN_PORT}",
         "--concurrency", "2", "--bootstrap-out", "/tmp/envoy-bootstrap.yaml"],
        {"http": ENVOY_PORT, "admin": ENVOY_ADMIN_PORT}, ("http", f"http://127.0.0.1:{ENVOY_ADMIN_PORT}/ready"),
        depends_on=[xds], metrics_path="/stats/prometheus"))
    targets = [{"cluster": "gateway", "address": f"{gateway_pods(gateway, prefix)}:{GATEWAY_PORT}", "health": "http"},
               {"cluster": "conductor", "address": f"{conductor}:{CONDUCTOR_PORT}", "health": "grpc"}]
    targets += [{"cluster": f"node-{g}", "address": f"{n}:{NODE_PORT}", "health": "grpc-mtls"} for g, n in node.items()]
    return Topology(config, services, targets)


def dns_label(name: str) -> str:
    """A node group name as a DNS label (Kubernetes object names): lower case, '-' for '_'."""
    return name.lower().replace("_", "-")


def gateway_pods(gateway: str, prefix: str) -> str:
    """The name that resolves to every gateway replica: compose's service name does; in
    Kubernetes a headless Service does (a ClusterIP Service resolves to one virtual IP)."""
    return f"{gateway}-pods" if prefix else gateway
