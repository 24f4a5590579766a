"""The front proxy of a mesh the launcher runs (``mstar serve --envoy``): the control plane
and Envoy as two more local processes, and a targets directory naming the mesh's services.

Another replica joins by writing a JSON file into that directory (``register``) and leaves
by removing it; one that stops answering its health check is taken out of Envoy anyway.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
import urllib.request
from pathlib import Path

from mstar import tls as mtls
from mstar.launcher import LaunchError, Service
from mstar.ports import free_port
from mstar.xds.envoy import EnvoyNotFound, envoy_binary


def node_cluster(group: str) -> str:
    return f"node-{group}"


def register(targets_dir: str | Path, name: str, cluster: str, address: str, health: str) -> Path:
    """Add one target (atomically: the control plane never reads half a file)."""
    path = Path(targets_dir) / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"cluster": cluster, "address": address, "health": health}]))
    tmp.replace(path)
    return path


class FrontProxy:
    def __init__(self, services: list[Service], host: str, envoy_port: int, *, python: str, log_level: str,
                 request_timeout_s: float, max_inflight: int, poll_s: float = 1.0, tls_args: list[str] | None = None):
        """``tls_args``: the mesh's TLS flags when its node groups serve mutual TLS (their health checks
        present the mesh's certificate), None for a plaintext mesh."""
        try:  # refuse at once rather than have a process die at start
            envoy_binary()
        except EnvoyNotFound as e:
            raise LaunchError(f"--envoy: {e}") from None
        try:
            stubs = importlib.util.find_spec("envoy.service.discovery.v3.ads_pb2_grpc") is not None
        except ModuleNotFoundError:
            stubs = False
        if not stubs:
            raise LaunchError("--envoy: the control plane needs the Envoy API stubs: `pip install xds-protos`")
        self.dir = Path(tempfile.mkdtemp(prefix="mstar-xds-"))
        self.targets = self.dir / "targets"
        self.targets.mkdir()
        for s in services:
            if s.kind == "gateway":
                register(self.targets, s.name, "gateway", s.address, "http")
            elif s.kind == "conductor":
                register(self.targets, s.name, "conductor", s.address, "grpc")
            elif s.kind == "node_group":
                register(self.targets, s.name, node_cluster(s.name), s.address, "grpc-mtls" if tls_args is not None else "grpc")
        self.xds_address = f"{host}:{free_port(host)}"
        self.host = host
        self._admin_file = self.dir / "envoy-admin-address"
        self.xds = Service("xds", "xds", self.xds_address, [
            python, "-m", "mstar.xds", "--address", self.xds_address, "--targets", str(self.targets),
            "--listen", f"{host}:{envoy_port}", "--poll-interval", str(poll_s), "--log-level", log_level,
            "--request-timeout", str(request_timeout_s), "--max-generate", str(max_inflight),
            *(tls_args or [f"--insecure-internal={mtls.QUIET}"])], takes_tls=tls_args is not None)
        self.envoy = Service("envoy", "envoy", f"{host}:{envoy_port}", [
            python, "-m", "mstar.xds.envoy", "--xds", self.xds_address, "--admin", f"{host}:0",
            "--admin-address-file", str(self._admin_file), "--bootstrap-out", str(self.dir / "bootstrap.yaml"),
            "--log-level", "warning" if log_level.upper() != "DEBUG" else "info"], probe=self.ready)

    @property
    def services(self) -> list[Service]:
        return [self.xds, self.envoy]

    @property
    def admin_url(self) -> str | None:
        try:
            address = self._admin_file.read_text().strip()
        except FileNotFoundError:
            return None
        return f"http://{address}" if address else None

    def _get(self, path: str) -> bytes | None:
        admin = self.admin_url
        if admin is None:
            return None
        try:
            with urllib.request.urlopen(f"{admin}{path}", timeout=1) as r:
                return r.read() if r.status == 200 else None
        except OSError:
            return None

    def ready(self) -> bool:
        """Envoy is initialised (its listener came over LDS) and knows the port it bound."""
        if self._get("/ready") is None:
            return False
        port = self.listener_port()
        if port:
            self.envoy.address = f"{self.host}:{port}"
        return bool(port)

    def listener_port(self) -> int | None:
        body = self._get("/listeners?format=json")
        if body is None:
            return None
        for status in json.loads(body).get("listener_statuses", []):
            port = status.get("local_address", {}).get("socket_address", {}).get("port_value")
            if port:
                return int(port)
        return None

    def describe(self) -> str:
        return (f"M* envoy: http://{self.envoy.address} (REST and gRPC; admin {self.admin_url}; "
                f"xDS {self.xds_address}; targets {self.targets})")

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
