"""Client side of ``twohosts.py``, run inside a namespace: prints one JSON line."""

from __future__ import annotations

import json
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


def wait_ready(conductor: str, timeout_s: str) -> dict:
    deadline = time.monotonic() + float(timeout_s)
    with grpc.insecure_channel(conductor) as ch:
        while time.monotonic() < deadline:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return {"ok": True}
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return {"ok": False}


def generate(conductor: str, text: str, kwargs_json: str = "{}", timeout_s: str = "20") -> dict:
    t0 = time.perf_counter()
    out: dict = {"ok": False}
    try:
        with grpc.insecure_channel(conductor, options=OPTIONS) as ch:
            chunks: dict[str, list] = {}
            for r in conductor_pb2_grpc.ConductorStub(ch).Generate(
                    cpb.GenerateRequest(model="toy", text=text, model_kwargs_json=kwargs_json), timeout=float(timeout_s)):
                for c in r.chunks:
                    chunks.setdefault(c.name, []).append(c)
        out["ok"] = True
        out["text"] = "".join(c.text for c in chunks.get("text", []))
        if "transfer" in chunks:
            t = chunks["transfer"][0].tensor
            from mstar import wire

            out["transfer"] = wire.from_proto(t).tolist()
    except grpc.RpcError as e:
        out["code"], out["details"] = e.code().name, e.details()
    out["seconds"] = time.perf_counter() - t0
    return out


def relay(conductor: str, sizes: str, repeats: str) -> dict:
    """Median seconds from the blob leaving node group 'front' to it arriving in 'back',
    per size (two warm-ups each: pools and mappings exist after them)."""
    from statistics import median

    from mstar import wire

    out = []
    with grpc.insecure_channel(conductor, options=OPTIONS) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        for size in map(int, sizes.split(",")):
            secs, walls = [], []
            for i in range(int(repeats) + 2):
                t0 = time.perf_counter()
                chunk = None
                for r in stub.Generate(cpb.GenerateRequest(model="toy", text="x", model_kwargs_json=json.dumps(
                        {"relay_bytes": size})), timeout=120):
                    chunk = r.chunks[0] if r.chunks else chunk
                n, seconds, _ = wire.from_proto(chunk.tensor).tolist()
                if int(n) != size:
                    raise RuntimeError(f"relay of {size} bytes delivered {n}")
                if i >= 2:
                    secs.append(seconds)
                    walls.append(time.perf_counter() - t0)
            med = median(secs)
            out.append({"bytes": size, "median_s": med, "gb_per_s": size / med / 1e9, "request_median_s": median(walls),
                        "samples": len(secs)})
    return {"points": out}


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return {"text": r.read().decode()}


def main() -> None:
    cmd, *args = sys.argv[1:]
    result = {"wait-ready": wait_ready, "generate": generate, "relay": relay, "scrape": scrape}[cmd](*args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
