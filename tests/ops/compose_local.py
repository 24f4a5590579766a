"""Run the M* services of a generated docker-compose.yml as local processes (no Docker
here): the same commands, volumes, start order (depends_on) and health checks, with
service DNS names mapped to 127.0.0.1 and every container port to a free local port.

What it proves: the generated commands, flags, addresses, targets file and health checks
work together. What it cannot: images, networks and GPU reservations (checked structurally).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from mstar.ports import free_port


class LocalCompose:
    def __init__(self, compose_dir: Path, image: str = "mstar:latest"):
        self.dir = Path(compose_dir)
        spec = yaml.safe_load((self.dir / "docker-compose.yml").read_text())
        self.services = {n: s for n, s in spec["services"].items() if s.get("image") == image}
        self.port: dict[tuple[str, int], int] = {}  # (service, container port) -> local port
        for name, s in self.services.items():
            for p in [*s.get("expose", []), *(x.split(":")[-1] for x in s.get("ports", []))]:
                self.port.setdefault((name, int(p)), free_port("127.0.0.1"))
        self.mounts: dict[str, str] = {}  # container path -> local path
        self.work = Path(tempfile.mkdtemp(prefix="mstar-compose-"))
        self.procs: dict[str, subprocess.Popen] = {}

    # -- rewriting -----------------------------------------------------------------------
    def _owner(self, port: int, me: str) -> str:
        if (me, port) in self.port:
            return me
        owners = [n for (n, p) in self.port if p == port]
        assert len(owners) == 1, f"{me}: port {port} is exposed by {owners}"
        return owners[0]

    def rewrite(self, text: str, me: str) -> str:
        names = "|".join(re.escape(n) for n in sorted(self.services, key=len, reverse=True))

        def local(m: re.Match) -> str:  # one pass: a rewritten address is never rewritten again
            host, port = m[1], int(m[2])
            owner = self._owner(port, me) if host in ("0.0.0.0", "127.0.0.1") else host
            return f"127.0.0.1:{self.port[(owner, port)]}"

        return re.sub(rf"\b({names}|0\.0\.0\.0|127\.0\.0\.1):(\d+)\b", local, text)

    def argv(self, command: list[str], me: str) -> list[str]:
        out, port_flag = [], False
        for arg in command:
            if port_flag:
                arg = str(self.port[(me, int(arg))])
            elif arg == "0.0.0.0":
                arg = "127.0.0.1"
            else:
                arg = self.rewrite(arg, me)
                for container, local in self.mounts.items():
                    arg = arg.replace(container, local)
            port_flag = arg in ("--port", "--metrics-port")
            out.append(sys.executable if arg == "python" else arg)
        return out

    def _mount(self, name: str) -> None:
        for volume in self.services[name].get("volumes", []):
            src, dst = volume.split(":")[:2]
            src_path = (self.dir / src).resolve()
            local = self.work / name / src_path.name
            local.parent.mkdir(parents=True, exist_ok=True)
            if src_path.is_dir():  # e.g. the control plane's targets: DNS names inside
                local.mkdir(exist_ok=True)
                for f in src_path.iterdir():
                    (local / f.name).write_text(self.rewrite(f.read_text(), name))
            else:
                local.write_text(src_path.read_text())
            self.mounts[dst] = str(local)

    # -- running -------------------------------------------------------------------------
    def order(self) -> list[str]:
        done: list[str] = []
        while len(done) < len(self.services):
            ready = [n for n, s in self.services.items() if n not in done
                     and all(d in done for d in s.get("depends_on", {}) if d in self.services)]
            assert ready, "depends_on has a cycle"
            done += ready
        return done

    def healthy(self, name: str) -> bool:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        r = subprocess.run(self.argv(test[1:], name), capture_output=True, timeout=10)
        return r.returncode == 0

    def up(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        for name in self.order():
            self._mount(name)
        for name in self.order():
            for dep, cond in self.services[name].get("depends_on", {}).items():
                if dep in self.services and cond["condition"] == "service_healthy":
                    while not self.healthy(dep):
                        assert self.procs[dep].poll() is None, f"{dep} exited with {self.procs[dep].returncode}"
                        assert time.monotonic() < deadline, f"{dep} did not become healthy"
                        time.sleep(0.3)
            log = open(self.work / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
            self.procs[name] = subprocess.Popen(self.argv(self.services[name]["command"], name),
                                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        for name in self.services:  # nothing depends on the last ones: wait for them too
            while not self.healthy(name):
                assert self.procs[name].poll() is None, f"{name} exited with {self.procs[name].returncode}"
                assert time.monotonic() < deadline, f"{name} did not become healthy"
                time.sleep(0.3)

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-tail:]}" for f in sorted(self.work.glob("*.log")))

    def url(self, name: str, port: int) -> str:
        return f"http://127.0.0.1:{self.port[(name, port)]}"

    def down(self) -> None:
        for name in reversed(self.order()):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.work, ignore_errors=True)
