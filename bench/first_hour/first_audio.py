"""`mstar serve orpheus --cache-dir DIR` as a user starts it: time to the ready line, then one
/v1/audio/speech request per response format (streamed): time to the first audio byte, total time,
audio length. Records what the services logged about devices, attention and CUDA graphs.

    python bench/first_hour/first_audio.py --cache-dir DIR --out OUT/first_audio.json [-- SERVE_ARGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

READY = re.compile(r"M\* ready: model '(\w+)' at (http://[\d.:]+)")
TEXT = "Hey there, this is a quick test of streaming speech synthesis on one GPU."
#: service log lines worth keeping: where groups run, which attention, CUDA graphs
FACTS = re.compile(r"M\* placement|attention on|CUDA graphs|captured decode|snac|engine process|orpheus llm loaded",
                   re.I)


def serve_command(cache_dir: str, extra: list[str]) -> list[str]:
    mstar = shutil.which("mstar")
    base = [mstar] if mstar else [sys.executable, "-m", "mstar.cli"]
    return [*base, "serve", "orpheus", "--cache-dir", cache_dir, "--port", "0", "--grpc-port", "0", *extra]


def wait_ready(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mstar serve exited with code {proc.returncode} before it was ready")
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            m = READY.search(proc.stdout.readline())
            if m:
                return m.group(2)
    raise SystemExit(f"mstar serve was not ready within {timeout_s:g} s")


def speech(url: str, fmt: str, max_tokens: int) -> dict:
    body = {"model": "orpheus", "input": TEXT, "voice": "tara", "response_format": fmt, "seed": 0,
            "max_tokens": max_tokens}
    req = urllib.request.Request(f"{url}/v1/audio/speech", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    first, data = None, bytearray()
    with urllib.request.urlopen(req, timeout=600) as r:
        headers = dict(r.headers)
        while chunk := r.read1(1 << 16):
            if first is None:
                first = time.perf_counter() - t0
            data += chunk
    total = time.perf_counter() - t0
    pcm = len(data) - (44 if fmt == "wav" else 0)
    rate = int(headers.get("X-Sample-Rate-Hz", 24000))
    return {"format": fmt, "first_byte_s": round(first or total, 4), "total_s": round(total, 3), "bytes": len(data),
            "audio_s": round(pcm / 2 / rate, 3), "transfer_encoding": headers.get("Transfer-Encoding", ""),
            "content_length": headers.get("Content-Length")}


def device_line() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "no nvidia-smi"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-tokens", type=int, default=700, help="per request (7 tokens = one 85 ms frame)")
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("serve_args", nargs="*", help="more `mstar serve` arguments (after --)")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.out.with_suffix(".serve.log")
    cmd = serve_command(args.cache_dir, args.serve_args)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            url = wait_ready(proc, args.ready_timeout)
            ready_s = time.perf_counter() - t0
            requests = [speech(url, fmt, args.max_tokens) for fmt in ("pcm", "wav", "pcm")]
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    facts = [line.strip() for line in log_path.read_text().splitlines() if FACTS.search(line)]
    result = {"command": " ".join(cmd), "device": device_line(), "ready_s": round(ready_s, 2),
              "requests": requests, "log_facts": facts[:40],
              "flashinfer_used": any("FlashInfer (paged" in f for f in facts),
              "cuda_graphs_used": any("captured decode CUDA graphs" in f for f in facts)}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
