"""Starts a whole mesh as local processes: one per node group, the conductor and the
gateway; waits for every health check; watches them; stops them all together."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mstar.config import Placement, PlacementConfig
from mstar.models import hub
from mstar.models.registry import create_model
from mstar.ports import PortInUse, free_port, taken_ports


class LaunchError(RuntimeError):
    pass


@dataclass
class LaunchOptions:
    config_path: Path
    host: str = "127.0.0.1"
    port: int = 8000  # gateway HTTP; 0 picks a free one
    grpc_port: int = 50051  # conductor; 0 picks a free one
    gpus: list[int] | None = None
    cache_dir: str | None = None
    protocol: str = "AUTO"
    log_level: str = "INFO"
    max_inflight: int = 256
    request_timeout_s: float = 300.0
    startup_timeout_s: float = 120.0
    envoy: bool = False  # also run the xDS control plane and an Envoy front proxy
    envoy_port: int = 10000  # Envoy's one port for REST and gRPC; 0 picks a free one
    download: bool = False  # fetch checkpoints missing from the local caches (mstar.models.hub)


@dataclass
class Service:
    name: str
    kind: str  # "node_group" | "conductor" | "gateway"
    address: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    metrics_port: int | None = None  # Prometheus /metrics (the gateway serves it on its HTTP port)
    probe: Callable[[], bool] | None = None  # health check, when neither gRPC health nor GET /health


class Mesh:
    """The processes of one deployment on this host."""

    def __init__(self, config: PlacementConfig, opts: LaunchOptions):
        self.config, self.opts = config, opts
        model = create_model(config.model, config.model_kwargs, opts.cache_dir)
        Placement(config, model)  # fail fast on a bad config...
        # ...or missing checkpoints (downloaded here when allowed), naming each and how to fetch it
        hub.ensure(model.checkpoints(), opts.cache_dir, download=opts.download, model=config.model)
        model.check_assets()  # ...or incomplete ones, with a message saying where to put them
        self.shm_prefix = f"mstar-{os.getpid()}-"
        h = opts.host
        groups = {g.name: f"{h}:{free_port(h)}" for g in config.node_groups}
        grpc_port = opts.grpc_port or free_port(h)
        http_port = opts.port or free_port(h)
        self.conductor_address = f"{h}:{grpc_port}"
        self.url = f"http://{h}:{http_port}"
        py, cfg, lvl = sys.executable, str(opts.config_path), opts.log_level
        self.services: list[Service] = []
        for g in config.node_groups:
            device = "cpu" if opts.gpus is None else f"cuda:{opts.gpus[g.ranks[0]]}"
            argv = [py, "-m", "mstar.services.node_group", "--config", cfg, "--group", g.name,
                    "--address", groups[g.name], "--peers", json.dumps(groups), "--conductor", self.conductor_address,
                    "--tensor-comm-protocol", opts.protocol, "--device", device, "--log-level", lvl]
            if opts.cache_dir:
                argv += ["--cache-dir", opts.cache_dir]
            if g.tp_size > 1 and opts.gpus is not None:  # the service starts ranks 1.. itself
                argv += ["--tp-devices", ",".join(f"cuda:{opts.gpus[r]}" for r in g.ranks)]
            self.services.append(Service(g.name, "node_group", groups[g.name], argv))
        self.services.append(Service("conductor", "conductor", self.conductor_address, [
            py, "-m", "mstar.conductor", "--config", cfg, "--address", self.conductor_address,
            "--groups", json.dumps(groups), "--tensor-comm-protocol", opts.protocol, "--log-level", lvl,
            "--max-inflight", str(opts.max_inflight), "--request-timeout", str(opts.request_timeout_s),
            *(["--cache-dir", opts.cache_dir] if opts.cache_dir else [])]))
        self.services.append(Service("gateway", "gateway", f"{h}:{http_port}", [
            py, "-m", "mstar.gateway", "--conductor", self.conductor_address, "--host", h,
            "--port", str(http_port), "--log-level", lvl, "--request-timeout", str(opts.request_timeout_s)]))
        self.proxy = None
        if opts.envoy:
            from mstar.xds.local import FrontProxy

            self.proxy = FrontProxy(self.services, h, opts.envoy_port, python=py, log_level=lvl,
                                    request_timeout_s=opts.request_timeout_s, max_inflight=opts.max_inflight)
            self.services += self.proxy.services
        for s in self.services:
            if s.kind not in ("gateway", "envoy"):
                s.metrics_port = free_port(h)
                s.argv += ["--metrics-port", str(s.metrics_port)]

    # -- start ---------------------------------------------------------------------------
    def ports(self) -> dict[str, int]:
        """Every port this mesh's services will listen on, by who binds it (0: the service
        picks a free one itself)."""
        flags = {"conductor": "--grpc-port", "gateway": "--port", "envoy": "--envoy-port"}
        out = {}
        for s in self.services:
            what = f"{s.kind} '{s.name}'" if s.kind == "node_group" else s.name
            flag = flags.get(s.kind)
            out[f"{what} ({flag})" if flag else what] = int(s.address.rsplit(":", 1)[1])
            if s.metrics_port is not None:
                out[f"{what} metrics"] = s.metrics_port
        return out

    def check_ports(self) -> None:
        """Raise PortInUse naming every port of this mesh that another socket holds (an M* mesh
        already running, another program): nothing has started yet."""
        taken = taken_ports(self.opts.host, self.ports())
        if taken:
            raise PortInUse(f"cannot start: {len(taken)} port(s) in use: {'; '.join(taken)}. Is another `mstar serve` "
                            f"running? Stop it, or pass other ports (--port, --grpc-port, --envoy-port; 0 picks a "
                            f"free one)")

    def start(self) -> None:
        env = {**os.environ, "MSTAR_SHM_PREFIX": self.shm_prefix}
        self.check_ports()
        try:
            for kind in ("node_group", "conductor", "gateway", "xds", "envoy"):
                batch = [s for s in self.services if s.kind == kind]
                for s in batch:
                    s.proc = subprocess.Popen(s.argv, env=env, stdin=subprocess.DEVNULL)
                for s in batch:
                    self._wait_healthy(s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, s: Service) -> None:
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while time.monotonic() < deadline:
            dead = self.dead()
            if dead is not None:
                raise LaunchError(f"service '{dead.name}' exited during startup with code {dead.proc.returncode}")
            if self._healthy(s):
                return
            time.sleep(0.1)
        raise LaunchError(f"service '{s.name}' did not become healthy within {self.opts.startup_timeout_s:g} s")

    @staticmethod
    def _healthy(s: Service) -> bool:
        if s.probe is not None:
            return s.probe()
        if s.kind == "gateway":
            try:
                with urllib.request.urlopen(f"http://{s.address}/health", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False
        try:
            with grpc.insecure_channel(s.address) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    # -- watch / stop --------------------------------------------------------------------
    def dead(self) -> Service | None:
        for s in self.services:
            if s.proc is not None and s.proc.poll() is not None:
                return s
        return None

    def stop(self, grace_s: float = 10.0) -> None:
        """Gateway first, node groups last: each drains in-flight work, then exits."""
        for kind in ("envoy", "xds", "gateway", "conductor", "node_group"):
            batch = [s for s in self.services if s.kind == kind and s.proc is not None and s.proc.poll() is None]
            for s in batch:
                s.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for s in batch:
                try:
                    s.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    s.proc.kill()
                    s.proc.wait()
        self.cleanup_shm()
        if self.proxy is not None:
            self.proxy.cleanup()

    def cleanup_shm(self) -> list[str]:
        """Remove shared-memory segments any of this mesh's services left behind."""
        left = glob.glob(f"/dev/shm/{self.shm_prefix}*")
        for path in left:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return left

    def describe(self) -> str:
        groups = [s.name for s in self.services if s.kind == "node_group"]
        lines = [f"M* ready: model '{self.config.model}' at {self.url} (gRPC {self.conductor_address}; "
                 f"{len(groups)} node group(s): {', '.join(groups)})",
                 f"M* metrics: {json.dumps(self.metrics_urls())}"]
        if self.proxy is not None:
            lines.append(self.proxy.describe())
        return "\n".join(lines)

    def metrics_urls(self) -> dict[str, str]:
        """Where Prometheus scrapes each service (Envoy: its admin interface)."""
        urls = {s.name: f"http://{s.address.rsplit(':', 1)[0]}:{s.metrics_port}/metrics"
                for s in self.services if s.metrics_port is not None}
        urls["gateway"] = f"{self.url}/metrics"
        if self.proxy is not None and self.proxy.admin_url:
            urls["envoy"] = f"{self.proxy.admin_url}/stats/prometheus"
        return urls


def run_forever(mesh: Mesh) -> int:
    """Serve until SIGINT/SIGTERM (exit 0) or until a service dies (exit 1, naming it)."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    mesh.start()
    print(mesh.describe(), flush=True)
    while not stopping:
        dead = mesh.dead()
        if dead is not None:
            print(f"mstar: service '{dead.name}' ({dead.kind}, {dead.address}) exited unexpectedly with code "
                  f"{dead.proc.returncode}; stopping the mesh", file=sys.stderr, flush=True)
            mesh.stop()
            return 1
        time.sleep(0.2)
    print("mstar: stopping (draining in-flight requests)", file=sys.stderr, flush=True)
    mesh.stop()
    return 0
