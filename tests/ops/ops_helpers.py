"""Helpers of the operations tests: a launched mesh, HTTP with deadlines, Prometheus scrapes."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from helpers import METRICS, READY, LauncherProcess

SECURITY = re.compile(r"M\* security: internal gRPC ([\d.:]+) \((mutual TLS, ([^)]+)|PLAINTEXT[^)]*)\); API keys (\w+)")
ENVOY = re.compile(r"M\* envoy: (http://[\d.:]+) \(REST and gRPC; admin (http://[\d.:]+); xDS ([\d.:]+); targets (\S+)\)")


class Launched(LauncherProcess):
    """``python -m mstar.cli <args>`` until its ready lines are printed."""

    def __init__(self, *args: str):
        super().__init__(*args)
        self.url = self.grpc = self.envoy = self.envoy_admin = self.targets = None
        # the conductor's internal (WalkEvents) address; how it is protected; the mesh's TLS folder (--tls-dir)
        self.internal = self.tls = self.tls_dir = None
        self.metrics: dict[str, str] = {}

    def wait_ready(self, timeout: float = 90.0, envoy: bool = False) -> Launched:
        def handle(line: str):
            if m := READY.search(line):
                self.url, self.grpc = m.group(2), m.group(3)
            elif m := SECURITY.search(line):
                self.internal, self.tls = m.group(1), m.group(2)
                self.tls_dir = m.group(3) if m.group(3) and m.group(3).startswith("/") else None  # None: in memory
            elif m := METRICS.search(line):
                self.metrics = json.loads(m.group(1))
                if not envoy:
                    return self
            elif m := ENVOY.search(line):
                self.envoy, self.envoy_admin, _, self.targets = m.groups()
                return self
            return None

        return self.wait_lines(handle, timeout)


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
