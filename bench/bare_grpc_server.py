"""Baseline for bench/mesh.py: a Conductor that does nothing, in its own process on
uvloop like ours — each Generate streams one chunk and a final event. What a bare
gRPC server-streaming call costs on this machine, for ratios."""

import asyncio
import sys

import grpc

from mstar.services.grpc_server import run_service
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc


class Bare(conductor_pb2_grpc.ConductorServicer):
    async def Generate(self, request, context):
        yield cpb.GenerateResponse(request_id="x", chunks=[cpb.OutputChunk(name="text", text="x")])
        yield cpb.GenerateResponse(request_id="x", final=cpb.FinalEvent())


async def serve(servicer: conductor_pb2_grpc.ConductorServicer) -> None:
    """Serve ``servicer`` on a free loopback port, print the port, stop when stdin closes."""
    server = grpc.aio.server()
    conductor_pb2_grpc.add_ConductorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await server.stop(None)


if __name__ == "__main__":
    run_service(serve(Bare()))
