"""Helpers of the operations tests: a launched mesh, HTTP with deadlines, Prometheus scrapes."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from helpers import stop_process

READY = re.compile(r"M\* ready: model '(\w+)' at (http://[\d.:]+) \(gRPC ([\d.:]+);")
METRICS = re.compile(r"M\* metrics: (\{.*\})")
SECURITY = re.compile(r"M\* security: internal gRPC ([\d.:]+) \((mutual TLS, (\S+)|PLAINTEXT[^)]*)\); API keys (\w+)")
ENVOY = re.compile(r"M\* envoy: (http://[\d.:]+) \(REST and gRPC; admin (http://[\d.:]+); xDS ([\d.:]+); targets (\S+)\)")


class Launched:
    """``python -m mstar.cli <args>`` until its ready lines are printed."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "mstar.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = self.grpc = self.envoy = self.envoy_admin = self.targets = None
        self.internal = self.tls_dir = None  # the conductor's internal (WalkEvents) address; the mesh's TLS folder
        self.metrics: dict[str, str] = {}
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def wait_ready(self, timeout: float = 90.0, envoy: bool = False) -> Launched:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited {self.proc.returncode}: {self.proc.stderr.read()[-3000:]}")
            try:
                line = self._lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if m := READY.search(line):
                self.url, self.grpc = m.group(2), m.group(3)
            elif m := SECURITY.search(line):
                self.internal, self.tls_dir = m.group(1), m.group(3)
            elif m := METRICS.search(line):
                self.metrics = json.loads(m.group(1))
                if not envoy:
                    return self
            elif m := ENVOY.search(line):
                self.envoy, self.envoy_admin, _, self.targets = m.groups()
                return self
        self.stop()
        raise AssertionError("launcher did not print its ready lines in time")

    def stop(self) -> int:
        return stop_process(self.proc, timeout=30)


def http(method: str, url: str, body=None, timeout: float = 20.0, headers: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(url: str, timeout: float = 5.0) -> dict[tuple[str, frozenset], float]:
    """Every sample of a /metrics page: (name, labels) -> value."""
    status, body = http("GET", url, timeout=timeout)
    assert status == 200, f"{url}: HTTP {status}"
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
