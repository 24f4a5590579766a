"""Issue 30 (part B): bad input never reaches a 5xx or a gRPC status other than INVALID_ARGUMENT
(RESOURCE_EXHAUSTED for a request over the size limit), and a refused request costs nothing
afterwards. A hand-written corpus of the findings, against a launcher mesh (real processes).

Each case reproduced on the earlier main: 3. ``timeout_s`` NaN over gRPC leaked an admission
slot (uvloop's timer refuses NaN after the request was registered); inf and 1e300 were taken as
"no deadline". 7. JSON nested 100k deep, an integer of 5,000 digits and a lone surrogate gave
500 (REST) or INTERNAL (gRPC), invalid protobuf bytes UNKNOWN, a request_id with CR/LF closed
the connection (non-stream) or sent a 500 whose headers disagreed with its body (stream).
9. a Cancel RPC was counted as ``requests_failed_total{code="UNKNOWN"}``.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.request
from urllib.parse import urlsplit

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from security_mesh import MAX_INFLIGHT

from mstar.conductor import act
from mstar.models.base import InvalidArgument
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

pytestmark = pytest.mark.e2e
WAIT_S = 10.0
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "7" * 5000
BIG_CHANNEL = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


# --- REST -------------------------------------------------------------------------------------

def post(mesh, path: str, body: bytes | str, content_type: str = "application/json",
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    """One request on its own connection: (status, headers, body); the connection must answer."""
    u = urlsplit(mesh.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=WAIT_S)
    try:
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        conn.request("POST", path, body=data, headers={"content-type": content_type, **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def assert_400(status: int, body: bytes, field: str | None) -> dict:
    assert status == 400, (status, body[:500])
    err = json.loads(body)["error"]
    assert err["code"] == "INVALID_ARGUMENT" and err["field"] == field, err
    return err


GENERATE_CASES = {
    # (raw JSON body, the field the 400 names)
    "deep model_kwargs": ('{"model": "toy", "text": "hi", "model_kwargs": {"a": ' + DEEP + "}}", None),
    "deep body": (DEEP, None),
    "nested 40 deep": ('{"model": "toy", "text": "hi", "model_kwargs": {"a": ' + "[" * 40 + "]" * 40 + "}}",
                       "model_kwargs.a" + "[0]" * 30),
    "huge int knob": ('{"model": "toy", "text": "hi", "model_kwargs": {"max_tokens": ' + HUGE_INT + "}}",
                      "model_kwargs.max_tokens"),
    "huge int timeout": ('{"model": "toy", "text": "hi", "timeout_s": ' + HUGE_INT + "}", "timeout_s"),
    "surrogate text": ('{"model": "toy", "text": "\\ud800"}', "text"),
    "surrogate model": ('{"model": "\\udfff", "text": "hi"}', "model"),
    "surrogate request_id": ('{"model": "toy", "text": "hi", "request_id": "\\ud800"}', "request_id"),
    "surrogate knob value": ('{"model": "toy", "text": "hi", "model_kwargs": {"stop": "\\ud800"}}', "model_kwargs.stop"),
    "surrogate knob key": ('{"model": "toy", "text": "hi", "model_kwargs": {"\\ud800": 1}}', "model_kwargs.<key>"),
    "NaN timeout": ('{"model": "toy", "text": "hi", "timeout_s": NaN}', "timeout_s"),
    "Infinity timeout": ('{"model": "toy", "text": "hi", "timeout_s": Infinity}', "timeout_s"),
    "overflowing timeout": ('{"model": "toy", "text": "hi", "timeout_s": 1e400}', "timeout_s"),
    "huge timeout": ('{"model": "toy", "text": "hi", "timeout_s": 1e300}', "timeout_s"),
    "NaN knob": ('{"model": "toy", "text": "hi", "model_kwargs": {"delay_ms": NaN}}', "model_kwargs.delay_ms"),
    "-Infinity knob": ('{"model": "toy", "text": "hi", "model_kwargs": {"delay_ms": -Infinity}}', "model_kwargs.delay_ms"),
    "huge knob": ('{"model": "toy", "text": "hi", "model_kwargs": {"delay_ms": 1e300}}', "model_kwargs.delay_ms"),
    "CRLF request_id": ('{"model": "toy", "text": "hi", "request_id": "a\\r\\nX-Evil: 1"}', "request_id"),
    "CRLF request_id stream": ('{"model": "toy", "text": "hi", "stream": true, "request_id": "a\\r\\nX: 1"}', "request_id"),
    "LF request_id": ('{"model": "toy", "text": "hi", "request_id": "a\\nb"}', "request_id"),
    "long request_id": ('{"model": "toy", "text": "hi", "request_id": "' + "r" * 129 + '"}', "request_id"),
    "prompt past max_seq_len": ('{"model": "toy", "text": "' + "a" * 70_000 + '"}', "text"),
}


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_refuses_with_400_naming_the_field(mesh, case):
    body, field = GENERATE_CASES[case]
    status, _, answer = post(mesh, "/generate", body)
    assert_400(status, answer, field)


OPENAI_CASES = {
    "/v1/chat/completions": [
        ('{"model": "toy", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        ('{"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + HUGE_INT + "}", "max_tokens"),
        ('{"model": "toy", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        ('{"model": "toy", "messages": ' + DEEP + "}", None),
    ],
    "/v1/audio/speech": [
        ('{"model": "toy", "input": "\\ud800", "voice": "x"}', "input"),
        ('{"model": "toy", "input": "hi", "voice": "x", "speed": Infinity}', "speed"),
    ],
    "/v1/images/generations": [
        ('{"model": "toy", "prompt": "\\udc00"}', "prompt"),
        ('{"model": "toy", "prompt": "hi", "n": ' + HUGE_INT + "}", "n"),
    ],
}


@pytest.mark.parametrize("path", OPENAI_CASES)
def test_openai_routes_refuse_with_400(mesh, path):
    for body, field in OPENAI_CASES[path]:
        status, _, answer = post(mesh, path, body)
        assert_400(status, answer, field)


def test_multipart_knobs_are_read_the_same_way(mesh):
    boundary = "XyZ"
    parts = [("model", "toy"), ("text", "hi"), ("model_kwargs", '{"delay_ms": NaN}')]
    body = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in parts)
    status, _, answer = post(mesh, "/generate", body + f"--{boundary}--\r\n", f"multipart/form-data; boundary={boundary}")
    assert_400(status, answer, "model_kwargs.delay_ms")
    parts[2] = ("timeout_s", "nan")
    body = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in parts)
    status, _, answer = post(mesh, "/generate", body + f"--{boundary}--\r\n", f"multipart/form-data; boundary={boundary}")
    assert_400(status, answer, "timeout_s")


def test_a_good_request_id_is_answered_in_its_header(mesh):
    status, headers, answer = post(mesh, "/generate", '{"model": "toy", "text": "hi", "request_id": "req-1.a/b:c"}')
    assert status == 200 and headers["X-Request-Id"] == "req-1.a/b:c", answer


# --- gRPC -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.grpc, options=BIG_CHANNEL) as ch:
        yield conductor_pb2_grpc.ConductorStub(ch), ch


def generate(stub, **fields) -> list[cpb.GenerateResponse]:
    return list(stub.Generate(cpb.GenerateRequest(model="toy", **fields), timeout=WAIT_S))


def invalid_field(e: grpc.RpcError) -> str:
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    status = rpc_status.from_call(e)
    bad = error_details_pb2.BadRequest()
    assert status is not None and status.details[0].Unpack(bad), e.details()
    return bad.field_violations[0].field


def test_nan_timeouts_never_leak_an_admission_slot(mesh, stub):
    s, _ = stub
    for _ in range(MAX_INFLIGHT * 4):
        with pytest.raises(grpc.RpcError) as e:
            generate(s, text="hi", timeout_s=float("nan"))
        assert invalid_field(e.value) == "timeout_s"
    for _ in range(MAX_INFLIGHT + 1):  # every slot is still free
        assert generate(s, text="hi")[-1].final.finish_reason == "stop"


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), 1e300, 61.0, -1.0])
def test_timeouts_past_the_limit_are_refused(stub, value):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub[0], text="hi", timeout_s=value)
    assert invalid_field(e.value) == "timeout_s"


@pytest.mark.parametrize("kwargs_json,field", [
    ('{"stop": "\\ud800"}', "model_kwargs.stop"),
    ("[" * 100_000, "model_kwargs_json"),
    ('{"a": ' + "[" * 50 + "]" * 50 + "}", "model_kwargs.a" + "[0]" * 31),
    ('{"max_tokens": ' + HUGE_INT + "}", "model_kwargs.max_tokens"),
    ('{"delay_ms": NaN}', "model_kwargs.delay_ms"),
    ('{"delay_ms": 1e999}', "model_kwargs.delay_ms"),
    ("{not json", "model_kwargs_json"),
    ("[1]", "model_kwargs_json"),
], ids=["surrogate", "100k deep", "50 deep", "huge int", "NaN", "overflow", "not JSON", "not an object"])
def test_bad_model_kwargs_json_is_invalid_argument(stub, kwargs_json, field):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub[0], text="hi", model_kwargs_json=kwargs_json)
    assert invalid_field(e.value) == field


@pytest.mark.parametrize("rid", ["a\r\nb", "a b", "x" * 129, "é"], ids=["CRLF", "space", "129 chars", "non-ASCII"])
def test_bad_request_ids_are_invalid_argument(stub, rid):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub[0], text="hi", request_id=rid)
    assert invalid_field(e.value) == "request_id"


@pytest.mark.parametrize("method,junk", [
    *((m, junk) for m in ("Generate", "Act", "Cancel", "ListModels")
      for junk in (b"\xff\xff\xff\xff", b"\x0a\x80")),  # a bad tag; a truncated length: no message parses them
    ("Generate", b"\x0a\x02\xff\xfe"),  # GenerateRequest.model (a string) that is not UTF-8
], ids=lambda v: v if isinstance(v, str) else v.hex())
def test_invalid_protobuf_bytes_are_invalid_argument(stub, method, junk):
    """A raw channel sends bytes that are not the request message: INVALID_ARGUMENT, not UNKNOWN."""
    _, ch = stub
    path = f"/mstar.v1.Conductor/{method}"
    call = (ch.unary_stream if method == "Generate" else ch.unary_unary)(
        path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        result = call(junk, timeout=WAIT_S)
        list(result) if method == "Generate" else None
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    assert "not a valid" in e.value.details()


def test_a_request_over_the_message_limit_is_refused_unread(stub):
    from mstar.limits import MAX_PUBLIC_MESSAGE_BYTES

    t0 = time.perf_counter()
    with pytest.raises(grpc.RpcError) as e:
        generate(stub[0], text="a" * (MAX_PUBLIC_MESSAGE_BYTES + 1))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most" in e.value.details()
    assert time.perf_counter() - t0 < 5


def test_a_long_prompt_is_refused_before_it_is_read_and_stalls_nobody(stub):
    """Finding 6, on the toy: a 30 MB prompt is refused by its length (it used to be read first:
    43 s for Orpheus); a small request beside it is answered at once."""
    s, _ = stub
    small: list[float] = []

    def beside():
        t = time.perf_counter()
        generate(s, text="hi", model_kwargs_json='{"max_tokens": 1}')
        small.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    th = threading.Thread(target=beside)
    th.start()
    with pytest.raises(grpc.RpcError) as e:
        generate(s, text="a" * (30 << 20))
    th.join(WAIT_S)
    assert invalid_field(e.value) == "text" and re.search(r"at most \d+ characters", e.value.details())
    assert time.perf_counter() - t0 < 5 and small and small[0] < 2, small


def test_act_refuses_non_finite_state():
    with pytest.raises(InvalidArgument) as e:
        act.prompt_from_act(cpb.ActRequest(model="pi05", task="t", state=[0.5, float("nan")]))
    assert act.act_field(e.value.field) == "state"


def test_a_cancel_rpc_counts_as_cancelled(mesh, stub):
    s, _ = stub

    def failed() -> dict[str, float]:
        with urllib.request.urlopen(mesh.metrics["conductor"], timeout=WAIT_S) as r:
            text = r.read().decode()
        return {m.group(1): float(m.group(2)) for m in
                re.finditer(r'mstar_requests_failed_total\{code="(\w+)",model="toy"\} (\S+)', text)}
    before = failed()
    call = s.Generate(cpb.GenerateRequest(model="toy", text="hello there", request_id="to-cancel",
                                          model_kwargs_json='{"delay_ms": 200}'), timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while not s.Cancel(cpb.CancelRequest(request_id="to-cancel"), timeout=WAIT_S).cancelled:
        assert time.monotonic() < deadline, "the request never became cancellable"
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + WAIT_S
    while failed().get("CANCELLED", 0) < before.get("CANCELLED", 0) + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = failed()
    assert after.get("CANCELLED", 0) == before.get("CANCELLED", 0) + 1, (before, after)
    assert after.get("UNKNOWN", 0) == before.get("UNKNOWN", 0), (before, after)
