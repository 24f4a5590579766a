"""Every example in examples/ run as a user would, against a real mesh: curl.sh, the SDK and
openai scripts, and the Node.js gRPC client (its dependencies from package-lock.json via npm ci)."""

import json
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from helpers import rot13

pytestmark = pytest.mark.e2e
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NODE_DIR = EXAMPLES / "node"
RUN_S = 60  # hard limit for each example run
HELLO = rot13("Hello, World.")


def run(cmd: list[str], timeout: float = RUN_S, cwd: Path = EXAMPLES) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return proc


def _wav(path: Path) -> tuple[int, int]:
    """Rate and frames of a WAV file; a streamed one's header says "length unknown" (0xFFFFFFFF),
    so the frames are counted, as a player reads them: to the end."""
    with wave.open(str(path)) as w:
        return w.getframerate(), len(w.readframes(w.getnframes())) // w.getsampwidth()


def test_curl_script(mesh, tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    proc = run(["bash", str(EXAMPLES / "curl.sh"), mesh.url, str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert '{"status": "ok"}' in out and '"id": "toy"' in out
    ndjson = [json.loads(x) for x in out.split("== POST /generate")[1].split("== POST /v1/chat")[0].splitlines()[1:]]
    assert "".join(x["text"] for x in ndjson if x.get("name") == "text") == HELLO
    assert ndjson[-1]["type"] == "final" and ndjson[-1]["usage"]["completion_tokens"] == 13
    chat = json.loads(out.split("== POST /v1/chat/completions\n")[1].splitlines()[0])
    assert chat["choices"][0]["message"]["content"] == HELLO and chat["usage"]["total_tokens"] == 26
    assert "data: [DONE]" in out
    assert _wav(tmp_path / "speech.wav") == (16000, 13 * 160)
    assert '"field": "model_kwargs.max_tokens"' in out


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_sdk_example(mesh, tmp_path, transport):
    url = mesh.url if transport == "rest" else mesh.grpc_url
    proc = run([sys.executable, str(EXAMPLES / "sdk_example.py"), "--url", url, "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert lines["health"] == "ok" and lines["models"].startswith("toy (outputs: text,")
    assert lines["streamed text"] == f"{HELLO} | finish: stop"
    assert lines["one-shot text"] == "nop | usage: 3 3"
    assert lines["chat"] == rot13("Hi there") and lines["async"] == rot13("async")
    assert lines["error"] == "InvalidArgument field=model_kwargs.max_tokens status=400"
    assert _wav(tmp_path / "speech.wav") == (16000, 5 * 160)


def test_openai_example(mesh, tmp_path):
    proc = run([sys.executable, str(EXAMPLES / "openai_example.py"), "--url", mesh.url, "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert lines["models"] == "toy" and lines["chat"] == f"{HELLO} | usage: 26"
    assert lines["stream"] == rot13("Hello") and lines["stream usage"] == "5"
    assert lines["error"] == "400 param=n"
    assert _wav(tmp_path / "speech.wav") == (16000, 5 * 160)


@pytest.fixture(scope="module")
def node_client():
    """node and npm, with examples/node's locked dependencies installed (npm ci) when missing or stale."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip(f"the Node.js example needs node and npm on PATH (node: {node}, npm: {npm})")
    lock = json.loads((NODE_DIR / "package-lock.json").read_text())["packages"]
    for pkg in ("@grpc/grpc-js", "@grpc/proto-loader"):
        installed = NODE_DIR / "node_modules" / pkg / "package.json"
        if not installed.exists() or json.loads(installed.read_text())["version"] != lock[f"node_modules/{pkg}"]["version"]:
            proc = run([npm, "ci", "--no-audit", "--no-fund"], timeout=180, cwd=NODE_DIR)
            assert proc.returncode == 0, f"npm ci failed: {proc.stderr[-3000:]}"
            break
    return node


def test_node_grpc_client_streams_generate(mesh, node_client):
    proc = run([node_client, "client.js", "--address", mesh.grpc, "--max-tokens", "64", "Hello, World."], cwd=NODE_DIR)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "models: toy"
    chunks = [line.split(" ", 3) for line in lines if line.startswith("chunk ")]
    text = [c for c in chunks if c[1].startswith("text#")]
    assert [c[1] for c in text] == [f"text#{i}" for i in range(13)] and all(c[2] == "text" for c in text)
    assert "".join(json.loads(c[3]) for c in text) == HELLO
    assert any(c[1].startswith("audio#") and c[3].endswith("audio/pcm 16000 Hz") for c in chunks)
    assert any(c[1] == "summary#0" and c[3] == "INT64[2]" for c in chunks)
    assert f"text: {HELLO}" in lines
    assert lines[-1] == "final finish_reason=stop prompt_tokens=13 completion_tokens=13 walks=2 audio_seconds=0.13"


def test_node_grpc_client_reports_the_status(mesh, node_client):
    proc = run([node_client, "client.js", "--address", mesh.grpc, "--max-tokens", "0", "hi"], cwd=NODE_DIR)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error INVALID_ARGUMENT: model_kwargs.max_tokens: must be an integer in [1, 4096], got 0"
    proc = run([node_client, "client.js", "--address", mesh.grpc, "--model", "nope", "hi"], cwd=NODE_DIR)
    assert proc.returncode == 1 and proc.stderr.startswith("error NOT_FOUND: ") and "nope" in proc.stderr
