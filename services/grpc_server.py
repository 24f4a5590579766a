"""What every M* gRPC server shares: message limits, standard health, reflection."""

from __future__ import annotations

import logging

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mstar import tls as mtls
from mstar.ports import EXIT_PORT_IN_USE, PortInUse
from mstar.services.links import SERVER_OPTIONS

#: grpc sets SO_REUSEPORT by default: a second server on a taken port then binds silently and
#: the kernel splits connections between the two (two conductors on 50051, each mesh's node
#: groups joining the other's conductor). Every M* server refuses to share its port.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


class ServerBase:
    """A grpc.aio server bound to ``address`` (port 0 picks a free port) with
    grpc.health.v1 (NOT_SERVING until ``set_serving``) and server reflection. With ``tls`` the
    port serves mutual TLS: a peer without a certificate of the mesh's CA is refused."""

    def __init__(self, address: str, service_names: list[str], tls: mtls.TLSSettings | None = None):
        self.server = grpc.aio.server(options=[*SERVER_OPTIONS, EXCLUSIVE_PORT])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        try:
            self.port = mtls.add_port(self.server, address, tls)
        except RuntimeError:  # grpc: "Failed to bind to address ..."
            self.port = 0
        if self.port == 0:
            raise PortInUse(f"cannot listen on {address}: the port is in use (another M* mesh or another program "
                            f"holds it); stop that process or pick another port")

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop_server(self, grace_s: float = 1.0) -> None:
        """Stop gRPC: calls still open after ``grace_s`` are cancelled. In a mesh those are the
        peers' long-lived streams, which end this way on every stop, so grpc's per-call
        "Aborting method ... due to server stop" warning is silenced here."""
        logging.getLogger("grpc._cython.cygrpc").setLevel(logging.ERROR)
        await self.server.stop(grace=grace_s)


def run_service(main) -> None:
    """Run a service's main coroutine on uvloop (about 25% less CPU per gRPC message
    than the default loop on our benchmarks). A port that cannot be bound ends the process
    with one line naming it (exit code EXIT_PORT_IN_USE), not a traceback."""
    try:
        uvloop.run(main)
    except PortInUse as e:
        logging.getLogger(__name__).error("%s", e)  # the service's log line names the service
        raise SystemExit(EXIT_PORT_IN_USE) from None
