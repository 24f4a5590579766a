"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

Host A runs the conductor and one node group, host B the other node group; every
service binds its namespace's veth address, so their traffic stays on that link and
cutting it (``link(False)``) cuts them apart. Used by the two-host test and benchmark.
Needs root (or CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TOOL = Path(__file__).with_name("twohosts_tool.py")


class NetnsUnavailable(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


@dataclass
class Proc:
    name: str
    host: str
    popen: subprocess.Popen
    log: Path


@dataclass
class TwoHosts:
    tag: str = field(default_factory=lambda: str(os.getpid() % 10_000_000))

    def __post_init__(self):
        pid = os.getpid()
        self.ns = {"a": f"mstar-a-{self.tag}", "b": f"mstar-b-{self.tag}"}
        self.veth = {"a": f"mva{self.tag}", "b": f"mvb{self.tag}"}
        net = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
        self.ip = {"a": f"{net}.1", "b": f"{net}.2"}
        self.procs: list[Proc] = []
        self.cleanups: list = []  # run by stop_all (the mesh's TLS folder)
        self.logdir = Path(f"/tmp/mstar-twohosts-{self.tag}")

    # -- namespaces ----------------------------------------------------------------------
    def create(self) -> TwoHosts:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2 ('ip') is not installed")
        if os.geteuid() != 0:
            raise NetnsUnavailable("creating network namespaces needs root")
        self.destroy()
        r = _ip("netns", "add", self.ns["a"], check=False)
        if r.returncode != 0:
            raise NetnsUnavailable(f"ip netns add failed: {r.stderr.strip()}")
        try:
            _ip("netns", "add", self.ns["b"])
            _ip("link", "add", self.veth["a"], "type", "veth", "peer", "name", self.veth["b"])
            for h in ("a", "b"):
                _ip("link", "set", self.veth[h], "netns", self.ns[h])
                self.exec_ip(h, "addr", "add", f"{self.ip[h]}/24", "dev", self.veth[h])
                self.exec_ip(h, "link", "set", "lo", "up")
                self.exec_ip(h, "link", "set", self.veth[h], "up")
        except subprocess.CalledProcessError as e:
            self.destroy()
            raise NetnsUnavailable(f"setting up the namespaces failed: {e.stderr.strip()}") from None
        self.logdir.mkdir(exist_ok=True)
        return self

    def exec_ip(self, host: str, *args: str) -> None:
        _ip("-n", self.ns[host], *args)

    def link(self, up: bool) -> None:
        """Bring the veth pair down (both ends: nothing gets through) or up again."""
        for h in ("a", "b"):
            self.exec_ip(h, "link", "set", self.veth[h], "up" if up else "down")

    def destroy(self) -> None:
        self.stop_all()
        for h in ("a", "b"):
            _ip("netns", "del", self.ns[h], check=False)  # deletes its veth end, and so the pair
        shutil.rmtree(self.logdir, ignore_errors=True)  # the processes' logs (read through logs() before)

    # -- processes -----------------------------------------------------------------------
    def cmd(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def spawn(self, name: str, host: str, argv: list[str], env: dict | None = None) -> Proc:
        log = self.logdir / f"{name}.log"
        with open(log, "wb") as out:  # the child keeps its own descriptor
            popen = subprocess.Popen(self.cmd(host, argv), stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        proc = Proc(name, host, popen, log)
        self.procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 5.0) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        self.procs = []
        for cleanup in self.cleanups:
            cleanup()
        self.cleanups = []

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ({p.host})\n{p.log.read_text()[-3000:]}" for p in self.procs if p.log.exists())

    def tool(self, host: str, *args: str, timeout: float = 60.0) -> dict:
        """Run the client tool inside a namespace; its one JSON line back."""
        r = subprocess.run(self.cmd(host, [sys.executable, str(TOOL), *args]), capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"twohosts tool {args[0]} failed ({r.returncode}): {r.stderr[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    # -- the toy mesh over the two hosts ---------------------------------------------------
    def start_mesh(self, config: str, protocol: str, ports=(7100, 7101, 7102, 7103), metrics_ports=(9100, 9101, 9102),
                   timeout_s: float = 60.0) -> dict:
        """Conductor + node group 'front' on host a, node group 'back' on host b. Returns
        their addresses; waits until the conductor is ready (every group joined). Internal gRPC
        crosses the link, so it runs with mutual TLS (a throwaway mesh certificate)."""
        from mstar import tls as mtls

        a, b = self.ip["a"], self.ip["b"]
        conductor, internal = f"{a}:{ports[0]}", f"{a}:{ports[3]}"
        tls_dir = str(mtls.write_mesh_ca(Path(tempfile.mkdtemp(prefix="mstar-twohosts-tls-")), [a, b]))
        self.cleanups.append(lambda: shutil.rmtree(tls_dir, ignore_errors=True))
        py, lvl = sys.executable, ["--log-level", "INFO"]
        common = ["--config", config, "--tensor-comm-protocol", protocol, "--tls-dir", tls_dir, *lvl]
        addrs = {"conductor": conductor, "front": f"{a}:{ports[1]}", "back": f"{b}:{ports[2]}"}
        metrics = {"conductor": f"http://{a}:{metrics_ports[0]}/metrics", "front": f"http://{a}:{metrics_ports[1]}/metrics",
                   "back": f"http://{b}:{metrics_ports[2]}/metrics"}
        self.spawn("conductor", "a", [py, "-m", "mstar.conductor", "--address", conductor, "--internal-address", internal,
                                      "--groups", "{}",
                                      "--metrics-port", str(metrics_ports[0]), *common])
        self.spawn("front", "a", [py, "-m", "mstar.services.node_group", "--group", "front", "--address", addrs["front"],
                                  "--conductor", internal, "--metrics-port", str(metrics_ports[1]), *common])
        self.spawn("back", "b", [py, "-m", "mstar.services.node_group", "--group", "back", "--address", addrs["back"],
                                 "--conductor", internal, "--metrics-port", str(metrics_ports[2]), *common])
        ready = self.tool("a", "wait-ready", conductor, str(timeout_s), timeout=timeout_s + 10)
        if not ready["ok"]:
            raise RuntimeError(f"the two-host mesh did not become ready: {ready}\n{self.logs()}")
        return {"addresses": addrs, "metrics": metrics}
