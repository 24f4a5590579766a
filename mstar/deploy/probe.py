"""``python -m mstar.deploy.probe grpc HOST:PORT`` or ``... http URL``: exit 0 when the
service is healthy (grpc.health.v1 SERVING; HTTP 200), 1 otherwise. The containers'
health check (compose has no built-in gRPC probe)."""

from __future__ import annotations

import sys
import urllib.request


def healthy(kind: str, target: str, timeout_s: float = 2.0) -> bool:
    if kind == "http":
        try:
            with urllib.request.urlopen(target, timeout=timeout_s) as r:
                return r.status == 200
        except OSError:
            return False
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("grpc", "http"):
        print("usage: python -m mstar.deploy.probe grpc HOST:PORT | http URL", file=sys.stderr)
        return 2
    return 0 if healthy(*args) else 1


if __name__ == "__main__":
    raise SystemExit(main())
