"""An in-process mesh: every node group and the conductor as real gRPC servers on
loopback inside one event loop. For tests and benchmarks that need the real wire
without process start-up costs; `mstar.launcher` runs the same servers as processes."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc

from mstar.conductor.replicas import Replicas
from mstar.conductor.requests import RequestTable
from mstar.conductor.server import ConductorServer
from mstar.config import Placement, PlacementConfig
from mstar.models.registry import create_model
from mstar.ports import PortInUse, free_port
from mstar.services.links import CHANNEL_OPTIONS
from mstar.services.node_group.runtime import NodeGroupRuntime
from mstar.services.node_group.server import NodeGroupServer
from mstar.services.transport import Protocol
from mstar.v1 import conductor_pb2_grpc


@dataclass
class InProcessMesh:
    config: PlacementConfig
    groups: dict[str, NodeGroupServer]
    conductor: ConductorServer
    address: str  # the public port (Conductor)
    channel: grpc.aio.Channel
    internal: str  # the internal port (WalkEvents), where node groups report and join

    @property
    def stub(self) -> conductor_pb2_grpc.ConductorStub:
        return conductor_pb2_grpc.ConductorStub(self.channel)

    def runtime(self, group: str) -> NodeGroupRuntime:
        return self.groups[group].runtime


#: tries with fresh ports when one was taken between choosing it and binding it (another test
#: process on this machine picking the same free port: rare, but CI runs two workers)
BIND_TRIES = 3


@contextlib.asynccontextmanager
async def inprocess_mesh(config: PlacementConfig, protocol: Protocol = Protocol.TCP, cache_dir: str | None = None,
                         **conductor_kw):
    for attempt in range(BIND_TRIES):
        groups: dict[str, NodeGroupServer] = {}
        conductor = None
        try:
            addrs = {g: f"127.0.0.1:{free_port('127.0.0.1')}" for g in config.group_names}
            conductor_address = f"127.0.0.1:{free_port('127.0.0.1')}"
            internal_address = f"127.0.0.1:{free_port('127.0.0.1')}"
            for g in config.group_names:
                model = create_model(config.model, config.model_kwargs, cache_dir)
                runtime = NodeGroupRuntime(g, model, Placement(config, model), addrs, internal_address, protocol)
                groups[g] = NodeGroupServer(addrs[g], runtime)
                await groups[g].start()
            model = create_model(config.model, config.model_kwargs, cache_dir)
            model.prepare_conductor()
            table = RequestTable(model, Placement(config, model), Replicas({g: [a] for g, a in addrs.items()}), protocol)
            conductor = ConductorServer(conductor_address, table, internal_address=internal_address, **conductor_kw)
            await conductor.start()
        except PortInUse:
            await _stop(groups, conductor)
            if attempt == BIND_TRIES - 1:
                raise
            continue
        try:
            async with grpc.aio.insecure_channel(conductor_address, options=CHANNEL_OPTIONS) as channel:
                yield InProcessMesh(config, groups, conductor, conductor_address, channel, internal_address)
        finally:
            await _stop(groups, conductor)
        return


async def _stop(groups: dict[str, NodeGroupServer], conductor: ConductorServer | None) -> None:
    # every service's outgoing streams close first: then no server waits out its grace for a
    # peer's stream (each would, one after another, and every mesh test would pay for it)
    await asyncio.gather(*(s.runtime.links.close() for s in groups.values()),
                         *([conductor.table.links.close()] if conductor is not None else []))
    await asyncio.gather(*(s.stop(grace_s=0.5) for s in groups.values()),
                         *([conductor.stop(grace_s=0.5)] if conductor is not None else []))
