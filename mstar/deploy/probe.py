"""``python -m mstar.deploy.probe grpc HOST:PORT``, ``... grpc-mtls HOST:PORT TLS_DIR`` (an internal
port: mutual TLS with the mesh's certificate) or ``... http URL``: exit 0 when the service is
healthy (grpc.health.v1 SERVING; HTTP 200), 1 otherwise. The containers' health check (compose
has no built-in gRPC probe; Kubernetes' cannot present a client certificate)."""

from __future__ import annotations

import sys
import urllib.request


def healthy(kind: str, target: str, tls_dir: str | None = None, timeout_s: float = 2.0) -> bool:
    if kind == "http":
        try:
            with urllib.request.urlopen(target, timeout=timeout_s) as r:
                return r.status == 200
        except OSError:
            return False
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mstar import tls as mtls

    try:
        with mtls.sync_channel(target, mtls.load(tls_dir) if kind == "grpc-mtls" else None) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not ((len(args) == 2 and args[0] in ("grpc", "http")) or (len(args) == 3 and args[0] == "grpc-mtls")):
        print("usage: python -m mstar.deploy.probe grpc HOST:PORT | grpc-mtls HOST:PORT TLS_DIR | http URL",
              file=sys.stderr)
        return 2
    return 0 if healthy(*args) else 1


if __name__ == "__main__":
    raise SystemExit(main())
