"""``mstar deploy compose|k8s --config FILE``: write a docker-compose stack or Kubernetes
manifests for a placement (see deploy/README.md and the README's Deploy section)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mstar.config import ConfigError, Placement, load_config
from mstar.deploy import compose, k8s
from mstar.deploy.topology import Options
from mstar.models.registry import UnknownModel, create_model


def add_parser(sub) -> None:
    p = sub.add_parser("deploy", help="generate docker-compose or Kubernetes deployment files from a placement YAML")
    targets = p.add_subparsers(dest="target", required=True)
    for name, what in (("compose", "a docker-compose stack (services, Envoy, control plane, Prometheus, Grafana)"),
                       ("k8s", "Kubernetes manifests (Deployments, Services, ConfigMaps, ServiceMonitor)")):
        t = targets.add_parser(name, help=what)
        t.add_argument("--config", required=True, help="placement YAML")
        t.add_argument("--out", help=f"output directory (default: deploy/{name}/<model>)")
        t.add_argument("--gpus", help="comma-separated CUDA device ids that YAML ranks map onto; node groups then "
                                      "reserve their GPUs (compose: device_ids; k8s: nvidia.com/gpu count)")
        t.add_argument("--image", default="mstar:latest", help="container image of every M* service (deploy/Dockerfile)")
        t.add_argument("--gateway-replicas", type=int, default=1, help="gateway replicas behind Envoy")
        t.add_argument("--node-replicas", action="append", default=[], metavar="GROUP=N",
                       help="replicas of a node group (repeatable; default 1 each)")
        t.add_argument("--max-inflight", type=int, default=256, help="conductor admission limit (also Envoy's limit)")
        t.add_argument("--request-timeout", type=float, default=300.0, help="default per-request timeout, seconds")
        t.add_argument("--log-level", default="INFO")


def main(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        Placement(config, create_model(config.model, config.model_kwargs))  # refuse what could never serve
        gpus = tuple(int(x) for x in args.gpus.split(",")) if args.gpus else None
        for g in config.node_groups if gpus is not None else ():
            bad = [r for r in g.ranks if r >= len(gpus)]
            if bad:
                raise ConfigError(f"node group '{g.name}': ranks {bad} but --gpus lists only {len(gpus)} device(s)")
        if args.gateway_replicas < 1:
            raise ValueError("--gateway-replicas must be >= 1")
        node_replicas = {}
        for item in args.node_replicas:
            group, _, n = item.partition("=")
            if not n.isdigit() or int(n) < 1:
                raise ValueError(f"--node-replicas expects GROUP=N with N >= 1, got '{item}'")
            node_replicas[group] = int(n)
        opts = Options(args.image, gpus, args.gateway_replicas, node_replicas, args.max_inflight, args.request_timeout,
                       args.log_level)
        out = Path(args.out or f"deploy/{args.target}/{config.model}")
        writer = compose.write if args.target == "compose" else k8s.write
        files = writer(config, Path(args.config).read_text(), out, opts)
    except (ConfigError, UnknownModel, ValueError, OSError) as e:
        print(f"mstar: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0
