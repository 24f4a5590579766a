"""Starts a whole mesh as local processes: one per node group, the conductor and the
gateway; waits for every health check; watches them; stops them all together."""

from __future__ import annotations

import glob
import json
import os
import shutil
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

from mstar import auth, lifetime
from mstar import tls as mtls
from mstar.config import Placement, PlacementConfig
from mstar.models import hub
from mstar.models.registry import create_model
from mstar.ports import EXIT_PORT_IN_USE, PortInUse, free_port, taken_ports
from mstar.services.transport import parse_protocol
from mstar.shm_names import PrefixLock

#: how often a start still waiting for a service says so on stderr (seconds)
WAIT_NOTE_S = 30.0
#: starts of a mesh whose services find a port chosen for them taken meanwhile (another mesh
#: starting at the same moment chose it too), each on freshly chosen ports
START_TRIES = 3


class LaunchError(RuntimeError):
    pass


class PortTaken(LaunchError):
    """A service could not listen on a port the launcher chose for it: another process bound it
    between the choice and the bind (the launcher starts the mesh again on other ports)."""


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
    max_inflight: int = 1024  # the conductor's admission limit: a GPU serves hundreds of streams at once
    request_timeout_s: float = 300.0
    startup_timeout_s: float = 900.0  # per service: checkpoint load, compile and CUDA-graph capture included
    envoy: bool = False  # also run the xDS control plane and an Envoy front proxy
    envoy_port: int = 10000  # Envoy's one port for REST and gRPC; 0 picks a free one
    download: bool = False  # fetch checkpoints missing from the local caches (mstar.models.hub)
    shm_prefix: str | None = None  # shared-memory segment names' prefix (None: mstar-<launcher pid>-)
    nvtx: bool = False  # MSTAR_NVTX=1 for every service (the caller checked that CUDA is there)
    torch_profile: str | None = None  # MSTAR_TORCH_PROFILE: node groups' and the conductor's torch.profiler traces go there
    upload_dir: str | None = None  # where the gateway spills large uploads (None: they stay in memory)
    upload_spill_mb: float = 1.0  # a file part larger than this goes to upload_dir
    upload_dir_max_mb: float = 1024.0  # the most the gateway keeps in upload_dir at once
    mooncake_port: int | None = None  # first of the ports Mooncake engines listen on (None: Mooncake picks)
    transfer_address: str | None = None  # IPv4 the node groups bind, so tensors cross there (None: host)
    tls_dir: str | None = None  # a folder with the mesh's certificate; None or "auto": a CA made in memory at start
    insecure_internal: bool = False  # internal gRPC in plaintext (loopback only; warned once)
    api_keys_file: str | None = None  # API keys of the public surfaces (also MSTAR_API_KEYS)
    per_key_max_inflight: int = 0  # in-flight requests per API key (0: no limit)

    def __post_init__(self):
        if not self.startup_timeout_s > 0:
            raise ValueError(f"--startup-timeout must be a positive number of seconds, got {self.startup_timeout_s:g}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout/--timeout must be a positive number of seconds, got "
                             f"{self.request_timeout_s:g}")
        if self.insecure_internal and self.tls_dir not in (None, "auto"):
            raise ValueError("--insecure-internal and --tls-dir exclude each other; pass one")
        if self.upload_dir is not None and not (self.upload_spill_mb >= 0 and self.upload_dir_max_mb > 0):
            raise ValueError(f"--upload-spill-mb must be >= 0 and --upload-dir-max-mb > 0, got "
                             f"{self.upload_spill_mb:g} and {self.upload_dir_max_mb:g}")
        parse_protocol(self.protocol)  # a known --tensor-comm-protocol, and RDMA only where Mooncake imports


@dataclass
class Service:
    name: str
    kind: str  # "node_group" | "conductor" | "gateway"
    address: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    metrics_port: int | None = None  # Prometheus /metrics (the gateway serves it on its HTTP port)
    probe: Callable[[], bool] | None = None  # health check, when neither gRPC health nor GET /health
    env: dict[str, str] | None = None  # this service's additions to the mesh's environment
    mooncake_ports: tuple[int, int] | None = None  # (first, last) its Mooncake engine may listen on
    tls: mtls.TLSSettings | None = None  # its gRPC port serves mutual TLS (health checks present the mesh's cert)
    takes_tls: bool = False  # started with the mesh's TLS flags (node groups, the conductor, the xDS control plane)
    internal_address: str | None = None  # the conductor's internal (WalkEvents) port

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]


class Mesh:
    """The processes of one deployment on this host."""

    def __init__(self, config: PlacementConfig, opts: LaunchOptions):
        self.config, self.opts = config, opts
        model = create_model(config.model, config.model_kwargs, opts.cache_dir)
        Placement(config, model)  # fail fast on a bad config...
        # ...or missing checkpoints (downloaded here when allowed), naming each and how to fetch it
        hub.ensure(model.checkpoints(), opts.cache_dir, download=opts.download, model=config.model)
        model.check_assets()  # ...or incomplete ones, with a message saying where to put them
        self.shm_prefix = opts.shm_prefix or f"mstar-{os.getpid()}-"
        self._prefix_lock = PrefixLock(self.shm_prefix)
        h = opts.host
        th = opts.transfer_address or h  # node groups: their links carry the tensors
        groups = {g.name: f"{th}:{free_port(th)}" for g in config.node_groups}
        grpc_port = opts.grpc_port or free_port(h)
        http_port = opts.port or free_port(h)
        self.conductor_address = f"{h}:{grpc_port}"  # public: Conductor (clients, gateway, Envoy)
        self.internal_address = f"{h}:{free_port(h)}"  # internal: WalkEvents (node groups)
        self.api_keys = auth.ApiKeys.load(opts.api_keys_file)  # checked here: a bad file stops the launch now
        self.tls, tls_args = self._tls(opts, [h, th])
        self._tls_by_pipe = self.tls is not None and not tls_args  # made in memory: handed over at start
        mtls.check_binds(self.tls, {**{f"node group '{g}'": a for g, a in groups.items()},
                                    "conductor internal port": self.internal_address}, "mstar serve")
        key_args = ["--api-keys-file", opts.api_keys_file] if opts.api_keys_file else []
        self.url = f"http://{h}:{http_port}"
        py, cfg, lvl = sys.executable, str(opts.config_path), opts.log_level
        self.services: list[Service] = []
        for g in config.node_groups:
            device = "cpu" if opts.gpus is None else f"cuda:{opts.gpus[g.ranks[0]]}"
            argv = [py, "-m", "mstar.services.node_group", "--config", cfg, "--group", g.name,
                    "--address", groups[g.name], "--peers", json.dumps(groups), "--conductor", self.internal_address,
                    "--tensor-comm-protocol", opts.protocol, "--device", device, "--log-level", lvl, *tls_args]
            if opts.cache_dir:
                argv += ["--cache-dir", opts.cache_dir]
            if g.tp_size > 1 and opts.gpus is not None:  # the service starts ranks 1.. itself
                argv += ["--tp-devices", ",".join(f"cuda:{opts.gpus[r]}" for r in g.ranks)]
            self.services.append(Service(g.name, "node_group", groups[g.name], argv, tls=self.tls, takes_tls=True))
        self.services.append(Service("conductor", "conductor", self.conductor_address, [
            py, "-m", "mstar.conductor", "--config", cfg, "--address", self.conductor_address,
            "--internal-address", self.internal_address, *tls_args, *key_args,
            "--per-key-max-inflight", str(opts.per_key_max_inflight),
            "--groups", json.dumps(groups), "--tensor-comm-protocol", opts.protocol, "--log-level", lvl,
            "--max-inflight", str(opts.max_inflight), "--request-timeout", str(opts.request_timeout_s),
            *(["--cache-dir", opts.cache_dir] if opts.cache_dir else [])], internal_address=self.internal_address,
            takes_tls=True))
        self.services.append(Service("gateway", "gateway", f"{h}:{http_port}", [
            py, "-m", "mstar.gateway", "--conductor", self.conductor_address, "--host", h, *key_args,
            "--port", str(http_port), "--log-level", lvl, "--request-timeout", str(opts.request_timeout_s),
            *(["--upload-dir", opts.upload_dir, "--upload-spill-mb", str(opts.upload_spill_mb),
               "--upload-dir-max-mb", str(opts.upload_dir_max_mb)] if opts.upload_dir else [])]))
        if opts.mooncake_port is not None:
            self._assign_mooncake_ports(opts.mooncake_port)
        self.proxy = None
        if opts.envoy:
            from mstar.xds.local import FrontProxy

            self.proxy = FrontProxy(self.services, h, opts.envoy_port, python=py, log_level=lvl,
                                    request_timeout_s=opts.request_timeout_s, max_inflight=opts.max_inflight,
                                    tls_args=tls_args if self.tls is not None else None)
            self.services += self.proxy.services
        for s in self.services:
            if s.kind not in ("gateway", "envoy"):
                s.metrics_port = free_port(s.host)
                s.argv += ["--metrics-port", str(s.metrics_port)]

    @staticmethod
    def _tls(opts: LaunchOptions, hosts: list[str]) -> tuple[mtls.TLSSettings | None, list[str]]:
        """The mesh's TLS and the flags its services get. By default a CA made in memory, handed to
        each service through a pipe at start (``--tls-fd``): no key is written anywhere, so a
        SIGKILLed launcher leaves none behind. ``--tls-dir DIR``: that folder's certificate (replicas
        started by hand can join). ``--insecure-internal``: plaintext, warned here once for all."""
        if opts.insecure_internal:
            return None, [f"--insecure-internal={mtls.QUIET}"]
        if opts.tls_dir in (None, "auto"):
            return mtls.TLSSettings.in_memory(hosts), []
        return mtls.TLSSettings.from_dir(opts.tls_dir), ["--tls-dir", opts.tls_dir]

    def _assign_mooncake_ports(self, first: int) -> None:
        """Each service that may start a Mooncake engine (node groups, the conductor) gets two
        ports of its own, [first + 2i, first + 2i + 1]: the engine's handshake (RPC) port and its
        TCP transport's port, both taken from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT."""
        users = [s for s in self.services if s.kind in ("node_group", "conductor")]
        last = first + 2 * len(users) - 1
        if not (1 <= first and last <= 65535):
            raise LaunchError(f"--mooncake-port {first}: this mesh's {len(users)} services need ports {first}-{last}; "
                              f"pass a port from 1 to {65536 - 2 * len(users)}")
        for i, s in enumerate(users):
            s.mooncake_ports = (first + 2 * i, first + 2 * i + 1)
            s.env = {**(s.env or {}), "MC_MIN_RPC_PORT": str(first + 2 * i), "MC_MAX_RPC_PORT": str(first + 2 * i + 1)}

    # -- start ---------------------------------------------------------------------------
    def ports(self) -> dict[str, dict[str, int]]:
        """Every port this mesh's services will listen on, by the address it is bound on and who
        binds it (0: the service picks a free one itself). Mooncake listens on every address."""
        flags = {"conductor": "--grpc-port", "gateway": "--port", "envoy": "--envoy-port"}
        out: dict[str, dict[str, int]] = {}
        for s in self.services:
            what = f"{s.kind} '{s.name}'" if s.kind == "node_group" else s.name
            flag = flags.get(s.kind)
            on = out.setdefault(s.host, {})
            on[f"{what} ({flag})" if flag else what] = int(s.address.rsplit(":", 1)[1])
            if s.internal_address is not None:
                on[f"{what} internal port"] = int(s.internal_address.rsplit(":", 1)[1])
            if s.metrics_port is not None:
                on[f"{what} metrics"] = s.metrics_port
            if s.mooncake_ports is not None:
                for k, port in enumerate(s.mooncake_ports, 1):
                    out.setdefault("0.0.0.0", {})[f"{what} Mooncake #{k} (--mooncake-port)"] = port
        return out

    def check_ports(self) -> None:
        """Raise PortInUse naming every port of this mesh that another socket holds (an M* mesh
        already running, another program): nothing has started yet."""
        taken = [t for host, ports in self.ports().items() for t in taken_ports(host, ports)]
        if taken:
            raise PortInUse(f"cannot start: {len(taken)} port(s) in use: {'; '.join(taken)}. Is another `mstar serve` "
                            f"running? Stop it, or pass other ports (--port, --grpc-port, --envoy-port: 0 picks a "
                            f"free one; --mooncake-port)")

    def environment(self) -> dict[str, str]:
        """What every service's environment adds to the launcher's."""
        return {"MSTAR_SHM_PREFIX": self.shm_prefix, **({"MSTAR_NVTX": "1"} if self.opts.nvtx else {}),
                **({"MSTAR_TORCH_PROFILE": self.opts.torch_profile} if self.opts.torch_profile else {})}

    def start(self) -> None:
        # a SIGKILLed launcher takes its services with it: each one's lifetime.adopt() (mstar/lifetime.py)
        env = {**os.environ, **self.environment(), **lifetime.child_env()}
        self.check_ports()
        self._prefix_lock.acquire()
        try:
            for kind in ("node_group", "conductor", "gateway", "xds", "envoy"):
                batch = [s for s in self.services if s.kind == kind]
                for s in batch:
                    s.proc = self._popen(s, {**env, **(s.env or {})})
                for s in batch:
                    self._wait_healthy(s)
        except BaseException:
            self.stop()
            raise

    def _popen(self, s: Service, env: dict[str, str]) -> subprocess.Popen:
        """Start ``s``; one that takes the mesh's TLS made in memory reads it from a pipe (``--tls-fd``)."""
        if not (s.takes_tls and self._tls_by_pipe):
            return subprocess.Popen(s.argv, env=env, stdin=subprocess.DEVNULL)
        r, w = os.pipe()
        try:
            with os.fdopen(w, "wb") as f:  # a few KiB: the pipe holds it until the service reads it
                f.write(self.tls.to_bundle())
            return subprocess.Popen([*s.argv, "--tls-fd", str(r)], env=env, stdin=subprocess.DEVNULL, pass_fds=(r,))
        finally:
            os.close(r)

    def _wait_healthy(self, s: Service) -> None:
        """Until ``s`` reports healthy; every WAIT_NOTE_S a line on stderr says which service the
        start is waiting for (a checkpoint loading, CUDA graphs being captured)."""
        start = time.monotonic()
        deadline, note = start + self.opts.startup_timeout_s, start + WAIT_NOTE_S
        while time.monotonic() < deadline:
            dead = self.dead()
            if dead is not None and dead.proc.returncode == EXIT_PORT_IN_USE:
                raise PortTaken(f"service '{dead.name}' could not listen on a port chosen for it: another process "
                                "took it meanwhile")
            if dead is not None:
                raise LaunchError(f"service '{dead.name}' exited during startup with code {dead.proc.returncode}")
            if self._healthy(s):
                return
            if time.monotonic() >= note:
                print(f"mstar: waiting for {s.kind} '{s.name}' ({s.address}) to report healthy: "
                      f"{time.monotonic() - start:.0f} s of --startup-timeout {self.opts.startup_timeout_s:g} s",
                      file=sys.stderr, flush=True)
                note += WAIT_NOTE_S
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
            with mtls.sync_channel(s.address, s.tls) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    # -- watch / stop --------------------------------------------------------------------
    def running(self) -> bool:
        """Some service of this mesh is still running."""
        return any(s.proc is not None and s.proc.poll() is None for s in self.services)

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
        self._prefix_lock.release()
        self.cleanup_uploads()
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

    def cleanup_uploads(self) -> None:
        """The gateway removes its upload folder as it stops; after a crash, the launcher does."""
        gateway = next(s for s in self.services if s.kind == "gateway")
        if self.opts.upload_dir and gateway.proc is not None:
            shutil.rmtree(Path(self.opts.upload_dir) / f"gateway-{gateway.proc.pid}", ignore_errors=True)

    def describe(self) -> str:
        groups = [s.name for s in self.services if s.kind == "node_group"]
        lines = [f"M* ready: model '{self.config.model}' at {self.url} (gRPC {self.conductor_address}; "
                 f"{len(groups)} node group(s): {', '.join(groups)})",
                 f"M* security: internal gRPC {self.internal_address} ("
                 f"{'mutual TLS, ' + self.tls.source if self.tls else 'PLAINTEXT, loopback only'}); API keys "
                 f"{'required' if self.api_keys.enabled else 'OFF: the public API is open'}",
                 f"M* metrics: {json.dumps(self.metrics_urls())}"]
        if self.proxy is not None:
            lines.append(self.proxy.describe())
        return "\n".join(lines)

    def profiled_pids(self) -> dict[str, int]:
        """The processes ``torch_profile`` arms (node groups and the conductor), by service name."""
        return {s.name: s.proc.pid for s in self.services if s.kind in ("node_group", "conductor") and s.proc}

    def metrics_urls(self) -> dict[str, str]:
        """Where Prometheus scrapes each service (Envoy: its admin interface)."""
        urls = {s.name: f"http://{s.address.rsplit(':', 1)[0]}:{s.metrics_port}/metrics"
                for s in self.services if s.metrics_port is not None}
        urls["gateway"] = f"{self.url}/metrics"
        if self.proxy is not None and self.proxy.admin_url:
            urls["envoy"] = f"{self.proxy.admin_url}/stats/prometheus"
        return urls


class _StopDuringStart(BaseException):
    """SIGINT/SIGTERM while the mesh was starting."""


def run_forever(make_mesh: Callable[[], Mesh], tries: int = START_TRIES) -> int:
    """Start the mesh ``make_mesh()`` builds, then serve until SIGINT/SIGTERM (exit 0) or until a
    service dies (exit 1, naming it). A start that fails with PortTaken is made again on a new
    mesh (its ports chosen again), up to ``tries`` starts. A signal during start stops what has
    started at once (exit 0), without waiting for the rest to load."""
    stopping = []

    def record(*_):
        stopping.append(1)

    def abort_start(*_):
        signal.signal(signal.SIGTERM, record)  # a second signal while stopping is only recorded
        signal.signal(signal.SIGINT, record)
        raise _StopDuringStart

    signal.signal(signal.SIGTERM, abort_start)
    signal.signal(signal.SIGINT, abort_start)
    mesh = None
    try:
        for attempt in range(1, tries + 1):
            mesh = make_mesh()
            try:
                mesh.start()  # its own failure handler stops every service it started
                break
            except PortTaken as e:
                if attempt == tries:
                    raise
                print(f"mstar: {e}; starting the mesh again on other ports (try {attempt + 1} of {tries})",
                      file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, record)
        signal.signal(signal.SIGINT, record)
    except _StopDuringStart:
        if mesh is not None and mesh.running():  # the signal came just after start() returned
            mesh.stop()
        print("mstar: stopped during startup", file=sys.stderr, flush=True)
        return 0
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
