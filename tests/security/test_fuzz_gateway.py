"""Issue 30 (part B): bad input never reaches a 5xx, fuzzed. Bounded and deterministic.

REST: schemathesis against the gateway's /openapi.json: examples, coverage (boundary and bad
values, missing fields, wrong types), fuzzing and the stateful phase (it follows the document's
links from /v1/models to every request route), positive and negative cases, at most
``MAX_EXAMPLES`` cases an operation and phase; fuzz_hooks.py says what every answer must be.
gRPC: hypothesis sends random bytes to every Conductor method over a raw channel (what does not
parse must be INVALID_ARGUMENT, never UNKNOWN) and GenerateRequests with fuzzed fields (never
INTERNAL or UNKNOWN).

``MSTAR_FUZZ_RECORD=1`` writes the figures to bench/results/security/fuzz.json.
"""

from __future__ import annotations

import base64
import collections
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import fuzz_hooks
import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

pytestmark = pytest.mark.e2e
HERE = Path(__file__).resolve().parent
RESULTS = HERE.parents[1] / "bench" / "results" / "security" / "fuzz.json"
MAX_EXAMPLES = 100
WAIT_S = 10.0
MESSAGES = {"Generate": cpb.GenerateRequest, "Act": cpb.ActRequest, "Cancel": cpb.CancelRequest,
            "ListModels": cpb.ListModelsRequest}
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                suppress_health_check=list(HealthCheck))


def record(section: str, figures: dict) -> None:
    if os.environ.get("MSTAR_FUZZ_RECORD") != "1":
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[section] = figures
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _asked_tiny_timeout(request: dict) -> bool:
    """As fuzz_hooks.py: the one 5xx allowed is the deadline the request asked for."""
    body = request.get("body") or {}
    raw = base64.b64decode(body["$base64"]) if isinstance(body, dict) and "$base64" in body else b""
    try:
        value = json.loads(raw).get("timeout_s")
        return isinstance(value, int | float) and value < fuzz_hooks.TINY_TIMEOUT_S
    except (ValueError, AttributeError):
        return False


def summarize(ndjson: Path) -> dict:
    """Requests sent and their answers, by status class and by generation mode, from the report."""
    by_class: collections.Counter = collections.Counter()
    by_status: collections.Counter = collections.Counter()
    by_mode: collections.Counter = collections.Counter()
    by_phase: collections.Counter = collections.Counter()
    for line in ndjson.read_text().splitlines():
        event = json.loads(line)
        finished = event.get("ScenarioFinished")
        if not finished:
            continue
        recorder = finished["recorder"]
        for case_id, interaction in recorder.get("interactions", {}).items():
            response = interaction.get("response")
            if response is None:
                by_class["no response"] += 1
                continue
            status = response["status_code"]
            tiny = status == 504 and _asked_tiny_timeout(interaction["request"])
            by_class["504 (its own timeout_s < 1 s)" if tiny else f"{status // 100}xx"] += 1
            by_status[str(status)] += 1
            meta = recorder["cases"].get(case_id, {}).get("value", {}).get("meta") or {}
            by_mode[meta.get("generation", {}).get("mode", "unknown")] += 1
            by_phase[finished["phase"]] += 1
    return {"requests": sum(by_class.values()), "status_classes": dict(by_class), "statuses": dict(by_status),
            "modes": dict(by_mode), "phases": dict(by_phase)}


@pytest.mark.timeout(240)
def test_schemathesis_stateful_and_negative_never_a_5xx(mesh, tmp_path):
    report = tmp_path / "events.ndjson"
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{mesh.url}/openapi.json",
           "--phases", "examples,coverage,fuzzing,stateful", "--mode", "all", "--max-examples", str(MAX_EXAMPLES),
           "--generation-deterministic", "--seed", "1", "--workers", "1",
           "--checks", "all", "--exclude-checks", "positive_data_acceptance,not_a_server_error",
           "--request-timeout", "10", "--suppress-health-check", "all", "--no-color",
           "--report", "ndjson", "--report-ndjson-path", str(report)]
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "PYTHONPATH": path}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    seconds = time.perf_counter() - t0
    out = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, out
    generated = re.search(r"(\d+) generated, (\d+) passed", proc.stdout)
    assert generated and generated.group(1) == generated.group(2), out
    assert "Stateful" in proc.stdout and "API Links:    4 covered" in proc.stdout, out
    figures = summarize(report)
    assert figures["requests"] >= 500 and "5xx" not in figures["status_classes"], figures
    assert figures["modes"].get("negative", 0) >= 100 and figures["phases"].get("stateful", 0) >= 50, figures
    record("rest_schemathesis", {**figures, "cases_generated": int(generated.group(1)), "seconds": round(seconds, 1),
                                 "max_examples": MAX_EXAMPLES, "phases_run": "examples,coverage,fuzzing,stateful",
                                 "mode": "all (positive and negative)", "deterministic": True})


# --- gRPC ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def channel(mesh):
    with grpc.insecure_channel(mesh.grpc) as ch:
        yield ch


def _parses(message, raw: bytes) -> bool:
    try:
        message.FromString(raw)
    except DecodeError:
        return False
    return True


def test_random_bytes_to_every_method_are_invalid_argument(channel):
    counts: collections.Counter = collections.Counter()
    raw = {m: channel.unary_unary(f"/mstar.v1.Conductor/{m}", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b) for m in MESSAGES if m != "Generate"}
    raw["Generate"] = channel.unary_stream("/mstar.v1.Conductor/Generate", request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)

    @FUZZ
    @given(method=st.sampled_from(sorted(MESSAGES)), data=st.binary(min_size=1, max_size=64))
    def one(method, data):
        try:
            result = raw[method](data, timeout=WAIT_S)
            list(result) if method == "Generate" else None
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        counts[code.name] += 1
        if not _parses(MESSAGES[method], data):
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, data, code)
        else:  # random bytes that happen to parse: a request like any other, never a server fault
            assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method, data, code)
    one()
    assert counts["INVALID_ARGUMENT"] >= 50, counts
    record("grpc_raw_bytes", {"requests": sum(counts.values()), "codes": dict(counts)})


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children,
                                                                                      max_size=3), max_leaves=8)
KWARGS_JSON = st.one_of(
    JSON.map(lambda v: json.dumps(v, allow_nan=True)),  # NaN / Infinity literals included
    st.sampled_from(['{"max_tokens": ' + "9" * 5000 + "}", "[" * 5000, '{"stop": "\\ud800"}', '{"max_tokens": 1e400}',
                     '{"max_tokens": 2}', '{"stop": "x", "max_tokens": 3}']),
    st.text(max_size=20))
REQUEST_ID = st.one_of(st.just(""), st.text(max_size=10), st.sampled_from(["a\r\nb", "x" * 200, "ok-1"]))
TIMEOUT = st.one_of(st.just(0.0), st.floats(allow_nan=True, allow_infinity=True), st.floats(1.0, 60.0))


def test_fuzzed_generate_requests_never_fail_as_the_servers_fault(channel):
    stub = conductor_pb2_grpc.ConductorStub(channel)
    counts: collections.Counter = collections.Counter()

    @FUZZ
    @given(model=st.sampled_from(["toy", "toy", "toy", "", "nope"]), text=st.text(max_size=24), kwargs_json=KWARGS_JSON,
           request_id=REQUEST_ID, timeout_s=TIMEOUT)
    def one(model, text, kwargs_json, request_id, timeout_s):
        req = cpb.GenerateRequest(model=model, text=text, model_kwargs_json=kwargs_json, request_id=request_id,
                                  timeout_s=timeout_s)
        try:
            list(stub.Generate(req, timeout=WAIT_S))
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        counts[code.name] += 1
        allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
        if math.isfinite(timeout_s) and 0 < timeout_s < 1:
            allowed.add(grpc.StatusCode.DEADLINE_EXCEEDED)  # the deadline the request asked for
        assert code in allowed, (req, code, details)
    one()
    assert counts["INVALID_ARGUMENT"] >= 30 and counts["OK"] >= 1, counts
    record("grpc_generate_fields", {"requests": sum(counts.values()), "codes": dict(counts)})


def test_the_record_is_readable():
    """The committed figures (MSTAR_FUZZ_RECORD=1 rewrites them) parse and show no server fault."""
    data = json.loads(RESULTS.read_text())
    assert "5xx" not in data["rest_schemathesis"]["status_classes"]
    for section in ("grpc_raw_bytes", "grpc_generate_fields"):
        assert not {"UNKNOWN", "INTERNAL"} & set(data[section]["codes"]), data[section]
