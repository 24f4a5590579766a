"""The node-group gRPC service: one process per YAML node group."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys

import grpc

from mstar import metrics
from mstar.config import Placement, load_config
from mstar.models.registry import create_model
from mstar.services.grpc_server import ServerBase, run_service
from mstar.services.node_group.runtime import NodeGroupRuntime
from mstar.services.transport import PROTOCOL_HELP, TensorReceiver, configure_service, parse_protocol
from mstar.v1 import conductor_pb2, conductor_pb2_grpc, node_group_pb2, node_group_pb2_grpc

log = logging.getLogger("mstar.node_group")
SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval: see main()


class NodeGroupServicer(node_group_pb2_grpc.NodeGroupServicer):
    def __init__(self, runtime: NodeGroupRuntime):
        self.runtime = runtime

    async def Exchange(self, request_iterator, context):
        receiver = TensorReceiver()
        yield node_group_pb2.Ack(receiver=self.runtime.location)
        try:
            async for batch in request_iterator:
                acks: list[int] = []
                self.runtime.on_batch(batch, await receiver.decode_batch_async(batch, acks))
                if acks:
                    yield node_group_pb2.Ack(released_buffer_ids=acks)
        finally:
            receiver.close()


class NodeGroupServer(ServerBase):
    def __init__(self, address: str, runtime: NodeGroupRuntime):
        super().__init__(address, [node_group_pb2.DESCRIPTOR.services_by_name["NodeGroup"].full_name])
        self.runtime = runtime
        node_group_pb2_grpc.add_NodeGroupServicer_to_server(NodeGroupServicer(runtime), self.server)
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.set_serving(False)  # grpc's health servicer starts out SERVING
        await self.server.start()
        self._loop_task = asyncio.get_running_loop().create_task(self.runtime.run())
        await self.set_serving(True)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.set_serving(False)
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.runtime.pending_requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(grace=1.0)
        if self._loop_task:
            self._loop_task.cancel()
        await self.runtime.close()


def create_server(address: str, runtime: NodeGroupRuntime) -> tuple[NodeGroupServer, int]:
    server = NodeGroupServer(address, runtime)
    return server, server.port


def advertise(address: str, port: int) -> str:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


async def join_conductor(conductor: str, group: str, address: str, leave: bool = False, retry_s: float = 0.5) -> None:
    """Offer this replica to the conductor (retrying until it answers), or withdraw it (once)."""
    fast_reconnect = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                      ("grpc.max_reconnect_backoff_ms", 1000)]  # the conductor may start after us
    async with grpc.aio.insecure_channel(conductor, options=fast_reconnect) as ch:
        stub = conductor_pb2_grpc.WalkEventsStub(ch)
        while True:
            try:
                resp = await stub.Join(conductor_pb2.JoinRequest(group=group, address=address, leave=leave), timeout=2.0,
                                       wait_for_ready=not leave)
                log.info("%s conductor %s: node group '%s' replicas now %s", "left" if leave else "joined", conductor,
                         group, list(resp.replicas))
                return
            except grpc.aio.AioRpcError as e:
                if leave or e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    log.warning("could not %s conductor %s: %s", "leave" if leave else "join", conductor, e.details())
                    return
            await asyncio.sleep(retry_s)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mstar-node-group", description="Serve one node group of a placement config.")
    p.add_argument("--config", required=True, help="placement YAML")
    p.add_argument("--group", required=True, help="node group name from the config")
    p.add_argument("--address", default="127.0.0.1:0", help="host:port to bind")
    p.add_argument("--peers", default="{}", help='JSON {"group": "host:port"}: default replicas of peer groups (requests '
                   "normally name the replicas they are pinned to)")
    p.add_argument("--advertise-address", default=None, help="host:port other services reach this replica at "
                   "(default: --address with its bound port; a wildcard host becomes this host's IP)")
    p.add_argument("--conductor", required=True, help="conductor host:port (for walk events)")
    p.add_argument("--tensor-comm-protocol", default="AUTO", help=PROTOCOL_HELP)
    p.add_argument("--port-file", metavar="PATH", help='write {"address", "port", "metrics_port"} as JSON to PATH '
                   "once serving (useful with port 0)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--log-level", default="INFO")
    metrics.add_metrics_arg(p)
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    config = load_config(args.config)
    model = create_model(config.model, config.model_kwargs, args.cache_dir)
    placement = Placement(config, model)
    protocol = parse_protocol(args.tensor_comm_protocol)
    configure_service(args.address, protocol)
    runtime = NodeGroupRuntime(args.group, model, placement, json.loads(args.peers), args.conductor,
                               protocol, args.device, args.cache_dir)
    for sub in runtime.submodules.values():
        if callable(getattr(sub, "kv_stats", None)):
            metrics.watch_kv(args.group, sub.kv_stats)
    server, port = create_server(args.address, runtime)
    metrics_port = None
    if args.metrics_port is not None:
        metrics_port = metrics.serve_metrics(args.address, args.metrics_port)
        log.info("node group '%s' metrics on port %d", args.group, metrics_port)
    await server.start()
    advertised = args.advertise_address or advertise(args.address, port)
    if args.port_file:  # for whoever started us with port 0: where we serve and export metrics
        tmp = f"{args.port_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"address": advertised, "port": port, "metrics_port": metrics_port}, f)
        os.replace(tmp, args.port_file)  # readers never see a half-written file
    log.info("node group '%s' serving %s on port %d (advertised as %s)", args.group, ", ".join(runtime.submodules), port, advertised)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    joining = loop.create_task(join_conductor(args.conductor, args.group, advertised))
    await stop.wait()
    log.info("node group '%s' draining", args.group)
    joining.cancel()
    await join_conductor(args.conductor, args.group, advertised, leave=True)
    await server.stop()


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s [{args.group}] %(name)s: %(message)s")
    # The event loop and each engine's stepping thread share the GIL. At Python's default
    # 5 ms switch interval a thread back from a GPU wait (GIL released) can sit up to 5 ms
    # behind the other one's routing; 0.5 ms keeps the hand-off well under a decode step.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    run_service(serve(args))


if __name__ == "__main__":
    main()
