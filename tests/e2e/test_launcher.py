"""End to end: `mstar serve` starts real processes; we talk real gRPC and HTTP on loopback."""

import glob
import json
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

from helpers import READY, LauncherProcess, rot13

pytestmark = pytest.mark.e2e


class Served(LauncherProcess):
    def __init__(self, *args: str, env: dict[str, str] | None = None):
        super().__init__(*args, env=env)
        self.url = self.grpc = None

    def wait_ready(self, timeout=90.0):
        def handle(line: str):
            if m := READY.search(line):
                self.url, self.grpc = m.group(2), m.group(3)
                return self
            return None

        return self.wait_lines(handle, timeout, "its ready line")

    def children(self) -> dict[str, int]:
        """Child service pids by service name."""
        out = {}
        for pid in open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split():
            cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
            if len(cmd) < 3:  # forked, not yet exec'd (the launcher's preexec_fn runs in between)
                continue
            name = cmd[cmd.index("--group") + 1] if "--group" in cmd else cmd[2].rsplit(".", 1)[-1]
            out[name] = int(pid)
        return out

def http(method, url, body=None, timeout=20):
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def served():
    s = Served("serve", "toy", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING").wait_ready()
    yield s
    code = s.stop()
    err = s.stderr()
    assert code == 0, err[-3000:]
    assert glob.glob(f"/dev/shm/mstar-{s.proc.pid}-*") == []
    # a clean stop says so quietly: services stopping one after another are no fault
    stopping = err[err.index("mstar: stopping"):]
    assert not re.search(r"WARNING|ERROR|Traceback", stopping), stopping[-3000:]


def test_rest_streaming_and_one_shot(served):
    status, body = http("POST", f"{served.url}/generate",
                        {"model": "toy", "text": "Hello, World.", "stream": True, "model_kwargs": {"max_tokens": 64}})
    assert status == 200
    lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
    assert lines[-1]["type"] == "final" and lines[-1]["usage"]["completion_tokens"] == 13
    assert "".join(x["text"] for x in lines if x.get("name") == "text") == rot13("Hello, World.")
    assert any(x.get("name") == "audio" for x in lines)
    status, body = http("POST", f"{served.url}/generate", {"model": "toy", "text": "abc"})
    assert status == 200 and json.loads(body)["outputs"]["text"]["text"] == "nop"


def test_rest_errors_name_the_field(served):
    status, body = http("POST", f"{served.url}/generate", {"model": "toy", "text": "hi", "model_kwargs": {"max_tokens": -1}})
    assert status == 400 and json.loads(body)["error"]["field"] == "model_kwargs.max_tokens"
    status, body = http("POST", f"{served.url}/generate", {"model": "nope", "text": "hi"})
    assert status == 404 and json.loads(body)["error"]["field"] == "model"
    assert http("GET", f"{served.url}/health")[0] == 200
    status, body = http("GET", f"{served.url}/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["toy"]


def test_grpc_and_reflection(served):
    with grpc.insecure_channel(served.grpc) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        chunks = list(stub.Generate(cpb.GenerateRequest(model="toy", text="grpc"), timeout=20))
        assert "".join(c.text for r in chunks for c in r.chunks if c.name == "text") == rot13("grpc")
        assert chunks[-1].final.finish_reason == "stop"
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        names = {s.name for s in resp.list_services_response.service}
        assert {"mstar.v1.Conductor", "grpc.health.v1.Health"} <= names


def test_killed_node_group_fails_request_and_launcher_names_it():
    s = Served("serve", "toy", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING").wait_ready()
    try:
        pids = s.children()
        assert {"encoder", "decoder", "audio", "conductor", "gateway"} <= set(pids)
        with grpc.insecure_channel(s.grpc) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            call = stub.Generate(cpb.GenerateRequest(model="toy", text="x" * 400,
                                                     model_kwargs_json='{"delay_ms": 10, "max_tokens": 400}'), timeout=30)
            next(call)  # the request is in flight
            t0 = time.monotonic()
            os.kill(pids["decoder"], signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as e:
                for _ in call:
                    pass
            assert time.monotonic() - t0 < 5
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "decoder" in e.value.details()
        code = s.proc.wait(30)
        err = s.stderr()
        assert code != 0 and "service 'decoder'" in err
        for name, pid in pids.items():
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", name
        assert glob.glob(f"/dev/shm/mstar-{s.proc.pid}-*") == []
    finally:
        s.stop()


def test_service_that_cannot_start_is_named():
    """A node group killed while it starts (importing takes seconds; we poll every 20 ms)."""
    s = Served("serve", "toy", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and s.proc.poll() is None:
        groups = {n: p for n, p in s.children().items() if n in ("encoder", "decoder", "audio")}
        if groups:
            name, pid = next(iter(groups.items()))
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    code = s.proc.wait(90)
    err = s.stderr()
    assert code != 0 and f"service '{name}' exited during startup with code -9" in err, err[-2000:]


def test_a_stop_while_starting_is_honoured_at_once():
    """SIGTERM while services still load stops what started, without waiting for the rest to
    become healthy (a slow checkpoint would otherwise hold the stop for --startup-timeout)."""
    s = Served("serve", "toy", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and s.proc.poll() is None and not s.children():
        time.sleep(0.02)
    started = s.children()
    assert started and s.proc.poll() is None, s.stderr(2000)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    code = s.proc.wait(30)
    err = s.stderr()
    assert code == 0 and "mstar: stopped during startup" in err and "Traceback" not in err, err[-2000:]
    assert time.monotonic() - t0 < 15, "the stop waited for the start"
    assert "M* ready" not in s.stdout()
    for pid in started.values():
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


@pytest.mark.parametrize("flag", ["--grpc-port", "--port"])
def test_a_taken_port_is_refused_before_anything_starts(flag):
    """A port held by another program (here a plain listening socket; a second M* is refused
    the same way, its servers do not share ports) fails the launch at once, naming the port
    and the flag, with no traceback and no service started."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"--port": "0", "--grpc-port": "0", flag: str(port)}
        s = Served("serve", "toy", *[x for kv in ports.items() for x in kv], "--log-level", "WARNING")
        code = s.proc.wait(60)
        out, err = s.stdout(), s.stderr()
    assert code == 2, err
    what = "conductor (--grpc-port)" if flag == "--grpc-port" else "gateway (--port)"
    assert f"{what} (127.0.0.1:{port}): Address already in use" in err and "Traceback" not in err, err
    assert "M* ready" not in out


def test_gpus_without_cuda_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: --gpus 0 is valid here")
    s = Served("serve", "toy", "--port", "0", "--grpc-port", "0", "--gpus", "0")
    assert s.proc.wait(60) == 2
    err = s.stderr()
    assert "--gpus 0: no CUDA here" in err and "--gpus ''" in err and "Traceback" not in err, err


def test_bad_config_is_refused_with_a_clear_message(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: toy\nnode_groups:\n  - node_names: [rot]\n")
    s = Served("serve", "toy", "--config", str(cfg))
    assert s.proc.wait(60) == 2
    assert "is not placed" in s.stderr()
