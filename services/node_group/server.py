"""The node-group gRPC service: one process per YAML node group."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys

import grpc

from mstar import env, lifetime, metrics, nvtx, torch_profile
from mstar import tls as mtls
from mstar.config import Placement, load_config
from mstar.models.registry import create_model
from mstar.services.engines.tensor_parallel import Rendezvous, TPSpec
from mstar.services.grpc_checked import add_checked
from mstar.services.grpc_server import ServerBase, run_service
from mstar.services.node_group.nodes import create_submodules
from mstar.services.node_group.runtime import NodeGroupRuntime
from mstar.services.transport import PROTOCOL_HELP, TensorReceiver, start_transport
from mstar.v1 import conductor_pb2, conductor_pb2_grpc, node_group_pb2, node_group_pb2_grpc

log = logging.getLogger("mstar.node_group")


class NodeGroupServicer(node_group_pb2_grpc.NodeGroupServicer):
    def __init__(self, runtime: NodeGroupRuntime):
        self.runtime = runtime

    async def Exchange(self, request_iterator, context):
        receiver = TensorReceiver()
        yield node_group_pb2.Ack(receiver=self.runtime.location)
        try:
            async for batch in request_iterator:
                acks: list[int] = []
                if nvtx.ACTIVE:
                    with nvtx.span(f"receive {len(batch.frames)} frames from {batch.sender}"):
                        decoded = await receiver.decode_batch_async(batch, acks)
                else:
                    decoded = await receiver.decode_batch_async(batch, acks)
                self.runtime.on_batch(batch, decoded)
                if acks:
                    yield node_group_pb2.Ack(released_buffer_ids=acks)
        finally:
            receiver.close()


class NodeGroupServer(ServerBase):
    def __init__(self, address: str, runtime: NodeGroupRuntime):
        super().__init__(address, [node_group_pb2.DESCRIPTOR.services_by_name["NodeGroup"].full_name], runtime.tls)
        self.runtime = runtime
        add_checked(node_group_pb2_grpc.add_NodeGroupServicer_to_server, NodeGroupServicer(runtime), self.server)
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.set_serving(False)  # grpc's health servicer starts out SERVING
        await self.server.start()
        self._loop_task = asyncio.get_running_loop().create_task(self.runtime.run())
        await self.set_serving(True)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.set_serving(False)
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.runtime.requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await self.stop_server(min(1.0, max(0.0, deadline - asyncio.get_running_loop().time())))
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


async def join_conductor(conductor: str, group: str, address: str, leave: bool = False, retry_s: float = 0.5,
                         tls: mtls.TLSSettings | None = None) -> None:
    """Offer this replica to the conductor's internal port (retrying until it answers), or
    withdraw it (once)."""
    fast_reconnect = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                      ("grpc.max_reconnect_backoff_ms", 1000)]  # the conductor may start after us
    async with mtls.aio_channel(conductor, tls, fast_reconnect) as ch:
        stub = conductor_pb2_grpc.WalkEventsStub(ch)
        while True:
            try:
                resp = await stub.Join(conductor_pb2.JoinRequest(group=group, address=address, leave=leave), timeout=2.0,
                                       wait_for_ready=not leave)
                log.info("%s conductor %s: node group '%s' replicas now %s", "left" if leave else "joined", conductor,
                         group, list(resp.replicas))
                return
            except grpc.aio.AioRpcError as e:
                if leave and e.code() == grpc.StatusCode.UNAVAILABLE:  # it stopped first (the whole mesh is stopping)
                    log.info("conductor %s is gone; node group '%s' has nothing to leave", conductor, group)
                    return
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
    p.add_argument("--conductor", required=True, help="the conductor's internal host:port (its --internal-address: "
                   "WalkEvents)")
    mtls.add_args(p)
    p.add_argument("--tensor-comm-protocol", default="AUTO", help=PROTOCOL_HELP)
    p.add_argument("--port-file", metavar="PATH", help='write {"address", "port", "metrics_port"} as JSON to PATH '
                   "once serving (useful with port 0)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp-devices", default=None, help="comma-separated devices of a tp_size > 1 group's ranks, rank 0 "
                   "first (default: --device and the devices after it: cuda:0 -> cuda:0,cuda:1; cpu for every rank)")
    p.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)  # set on the followers rank 0 starts
    p.add_argument("--tp-init", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--log-level", default="INFO")
    metrics.add_metrics_arg(p)
    return p.parse_args(argv)


def tp_devices(device: str, size: int, given: str | None) -> list[str]:
    if given:
        devices = [d.strip() for d in given.split(",")]
        if len(devices) != size:
            raise ValueError(f"--tp-devices lists {len(devices)} devices; the group has tp_size={size}")
        return devices
    if device.startswith("cuda"):
        first = int(device.partition(":")[2] or 0)
        return [f"cuda:{first + i}" for i in range(size)]
    return [device] * size


class Followers:
    """Tensor-parallel ranks 1.. of this node group: child processes that mirror rank 0's
    engine. One that exits takes the service down (rank 0 would wait on it forever)."""

    def __init__(self, args: argparse.Namespace, size: int):
        devices = tp_devices(args.device, size, args.tp_devices)
        self.rendezvous = Rendezvous()
        self.spec = TPSpec(0, size, self.rendezvous.init_method)
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, size):
                argv = [sys.executable, "-m", "mstar.services.node_group", "--config", args.config, "--group",
                        args.group, "--conductor", args.conductor, "--device", devices[rank], "--tp-rank", str(rank),
                        "--tp-init", self.spec.init_method, "--log-level", args.log_level,
                        *(["--cache-dir", args.cache_dir] if args.cache_dir else [])]
                self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                                   env={**os.environ, **lifetime.child_env()}))
        except BaseException:
            self.kill()
            raise
        log.info("node group '%s': tensor-parallel ranks 1..%d started on %s", args.group, size - 1, devices[1:])

    async def watch(self, on_exit) -> None:
        while True:
            for rank, p in enumerate(self.procs, 1):
                if p.poll() is not None:
                    on_exit(f"tensor-parallel rank {rank} exited with code {p.returncode}")
                    return
            await asyncio.sleep(0.5)

    def stop(self, wait_s: float = 10.0) -> None:
        for p in self.procs:
            try:
                p.wait(wait_s)  # released by rank 0's close
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.rendezvous.close()

    def kill(self) -> None:
        """At once, on a failure: every rank still running, and the rendezvous directory."""
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.rendezvous.close()


async def watch_engines(runtime: NodeGroupRuntime, on_exit, interval_s: float = 0.5) -> None:
    """Call ``on_exit(why)`` once an engine node can no longer step (its process died)."""
    while True:
        for node, sub in runtime.engines.items():
            why = sub.exit_reason()
            if why:
                on_exit(f"node '{node}': {why}")
                return
        await asyncio.sleep(interval_s)


def follow(args: argparse.Namespace) -> None:
    """A tensor-parallel rank past 0: load this rank's shard and mirror rank 0's passes."""
    config = load_config(args.config)
    model = create_model(config.model, config.model_kwargs, args.cache_dir)
    spec = TPSpec(args.tp_rank, config.group(args.group).tp_size, args.tp_init)
    subs = create_submodules(model, Placement(config, model), args.group, args.device, args.cache_dir, spec)
    (sub,) = subs.values()  # the config allows one node per tensor-parallel group
    log.info("node group '%s' tensor-parallel rank %d following on %s", args.group, args.tp_rank, args.device)
    sub.follow()
    sub.tensor_parallel.close()
    log.info("node group '%s' tensor-parallel rank %d released", args.group, args.tp_rank)


async def serve(args: argparse.Namespace) -> None:
    try:
        tls = mtls.from_args(args, {"--address": args.address}, f"node group '{args.group}'")
    except ValueError as e:
        log.error("%s", e)
        raise SystemExit(2) from None
    config = load_config(args.config)
    model = create_model(config.model, config.model_kwargs, args.cache_dir)
    placement = Placement(config, model)
    protocol = start_transport(args.address, args.tensor_comm_protocol, f"node group '{args.group}'")
    size = config.group(args.group).tp_size
    followers = Followers(args, size) if size > 1 else None
    try:
        runtime = NodeGroupRuntime(args.group, model, placement, json.loads(args.peers), args.conductor,
                                   protocol, args.device, args.cache_dir, followers.spec if followers else None, tls)
    except BaseException:
        if followers:
            followers.kill()
        raise
    for sub in runtime.engines.values():
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
    joining = loop.create_task(join_conductor(args.conductor, args.group, advertised, tls=tls))
    failure: list[str] = []

    def lost(why: str) -> None:
        failure.append(why)
        stop.set()

    watching = [loop.create_task(watch_engines(runtime, lost))]
    if followers:
        watching.append(loop.create_task(followers.watch(lost)))
    profile = torch_profile.arm(args.group, loop)
    await stop.wait()
    await torch_profile.write_pending(profile, loop)
    log.info("node group '%s' draining", args.group)
    runtime.links.drain()
    joining.cancel()
    await join_conductor(args.conductor, args.group, advertised, leave=True, tls=tls)
    if failure:  # an engine that cannot step (or would block on a dead rank): leave at once, the conductor fails its requests
        log.error("node group '%s': %s; stopping", args.group, failure[0])
        if followers:
            followers.kill()  # os._exit runs no clean-up of its own
        os._exit(1)
    for task in watching:
        task.cancel()
    await server.stop()
    if followers:
        await loop.run_in_executor(None, followers.stop)


def main(argv=None) -> None:
    args = parse_args(argv)
    who = args.group if not args.tp_rank else f"{args.group}:tp{args.tp_rank}"
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s [{who}] %(name)s: %(message)s")
    env.apply_torch_threads(1 if args.device.startswith("cuda") else None)  # a CPU group computes on the CPU
    if args.tp_rank:
        follow(args)
        return
    # The event loop and each engine's stepping thread share the GIL. At Python's default
    # 5 ms switch interval a thread back from a GPU wait (GIL released) can sit up to 5 ms
    # behind the other one's routing; 0.5 ms (MSTAR_GIL_SWITCH_INTERVAL_S) keeps the hand-off
    # well under a decode step.
    sys.setswitchinterval(env.settings().gil_switch_interval_s)
    nvtx.from_settings()
    run_service(serve(args))


if __name__ == "__main__":
    main()
