"""Where a node group's frames go: its links, and the routes frames name.

Each peer group given at start has a default replica (frames that carry no route go there);
the conductor has a report link. A request is pinned to replicas by the routes its frames
carry, and routes are untrusted input: a replica that only a frame's routes name gets the
request's tensors once the conductor confirms it announced it (``WalkEvents.CheckRoute``).
"""

from __future__ import annotations

import grpc

from mstar import nvtx
from mstar import tls as mtls
from mstar.config import Placement
from mstar.services.links import Link, Links, OnDown
from mstar.services.node_group.requests import CONDUCTOR, RequestFailed, Send
from mstar.services.transport import Protocol
from mstar.v1 import conductor_pb2, conductor_pb2_grpc


class Routes:
    def __init__(self, group: str, placement: Placement, peers: dict[str, str | list[str]], conductor: str,
                 protocol: Protocol, on_down: OnDown, tls: mtls.TLSSettings | None = None):
        """``peers``: each group's replica address(es) known at start (one becomes its default);
        ``conductor``: its internal (WalkEvents) address."""
        self.group, self.placement, self.tls = group, placement, tls
        self._conductor_channel: grpc.aio.Channel | None = None  # CheckRoute calls
        self.links = Links(group, protocol, on_down, tls=tls, check_route=self.check)
        for peer, addresses in peers.items():  # defaults for frames that carry no route
            address = addresses if isinstance(addresses, str) else addresses[0] if len(addresses) == 1 else None
            if peer != group and address:
                self.links.add(peer, address)
        self.links.add(CONDUCTOR, conductor, kind="report")

    def link(self, routes: dict[str, str], target: str) -> Link:
        """The link to the conductor, or to the replica of group ``target`` a request with
        ``routes`` is pinned to."""
        if target == CONDUCTOR:
            return self.links[CONDUCTOR]
        try:
            return self.links.route(target, routes)
        except KeyError as e:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"node group '{self.group}': {e.args[0]}") from None

    def send(self, routes: dict[str, str], effect: Send) -> None:
        """The router's ``Send``, on its link (``link``); under a profiler, a range per frame with tensors."""
        link = self.link(routes, effect.target)
        if nvtx.ACTIVE and effect.tensors:
            with nvtx.span(f"send {effect.frame.edge} -> {effect.target}"):
                link.send(effect.frame, effect.tensors)
        else:
            link.send(effect.frame, effect.tensors)

    async def check(self, group: str, address: str) -> str | None:
        """None once the conductor confirms it announced ``address`` as a replica of ``group``,
        else why that route is refused."""
        if group not in self.placement.config.group_names:
            return f"the routes name '{group}', which is not a node group of this placement"
        if self._conductor_channel is None:
            self._conductor_channel = mtls.aio_channel(self.links[CONDUCTOR].address, self.tls)
        try:
            resp = await conductor_pb2_grpc.WalkEventsStub(self._conductor_channel).CheckRoute(
                conductor_pb2.CheckRouteRequest(group=group, address=address), timeout=5.0)
        except grpc.aio.AioRpcError as e:
            return f"the conductor could not confirm this route: {e.code().name}: {e.details()}"
        if resp.announced:
            return None
        return (f"the conductor never announced {address} as a replica of node group '{group}'; a frame's routes may "
                f"only name replicas the conductor announced")

    async def close(self) -> None:
        await self.links.close()
        if self._conductor_channel is not None:
            await self._conductor_channel.close()
