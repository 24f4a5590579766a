"""Aggregated Discovery Service, state of the world: every response carries all resources
of its type (or all the client named, for EDS and RDS). Each type has a content version;
a stream sends a type when the client asks for it and has not got the current version, or
names other resources, and again whenever the snapshot's version of that type changes.
ACKs (same version back) and NACKs (error_detail set) are answered with nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging

from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message

from mstar import metrics
from mstar.xds.resources import TYPES

log = logging.getLogger("mstar.xds")


class Snapshot:
    """The current resources of every type, their versions, and the streams to tell."""

    def __init__(self) -> None:
        self.resources: dict[str, dict[str, Message]] = {t: {} for t in TYPES}
        self.versions: dict[str, str] = {t: "" for t in TYPES}
        self._subscribers: set[asyncio.Queue] = set()

    def update(self, resources: dict[str, dict[str, Message]]) -> list[str]:
        """Replace the resources; returns the types whose content changed."""
        changed = []
        for t in TYPES:
            items = resources.get(t, {})
            digest = hashlib.sha256()
            for name in sorted(items):
                digest.update(name.encode() + b"\0" + items[name].SerializeToString(deterministic=True))
            version = digest.hexdigest()[:16]
            if version != self.versions[t]:
                self.resources[t], self.versions[t] = items, version
                changed.append(t)
        if changed:
            for q in self._subscribers:
                q.put_nowait(("snapshot", None))
        return changed

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)


class AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot

    async def StreamAggregatedResources(self, request_iterator, context):
        inbox = self.snapshot.subscribe()

        async def read() -> None:
            try:
                async for req in request_iterator:
                    inbox.put_nowait(("request", req))
            finally:
                inbox.put_nowait(("end", None))

        reader = asyncio.get_running_loop().create_task(read())
        wanted: dict[str, list[str]] = {}  # type -> resource names asked for ([]: all)
        sent: dict[str, str] = {}  # type -> version sent last
        nonces = itertools.count(1)
        peer = context.peer()
        try:
            while True:
                kind, req = await inbox.get()
                if kind == "end":
                    return
                if kind == "request":
                    t = req.type_url
                    if t not in self.snapshot.versions:
                        log.warning("%s asked for unsupported type %s", peer, t)
                        continue
                    if req.HasField("error_detail"):
                        log.warning("%s rejected %s version %s: %s", peer, t.rsplit(".", 1)[-1], req.version_info,
                                    req.error_detail.message)
                    names = list(req.resource_names)
                    renamed = wanted.get(t) != names
                    wanted[t] = names
                    todo = [t] if renamed or sent.get(t) != self.snapshot.versions[t] else []
                else:
                    todo = [t for t in TYPES if t in wanted and sent.get(t) != self.snapshot.versions[t]]
                for t in todo:
                    sent[t] = self.snapshot.versions[t]
                    yield self._response(t, wanted[t], str(next(nonces)))
        finally:
            reader.cancel()
            self.snapshot.unsubscribe(inbox)

    def _response(self, type_url: str, names: list[str], nonce: str) -> discovery_pb2.DiscoveryResponse:
        items = self.snapshot.resources[type_url]
        chosen = [items[n] for n in (names or sorted(items)) if n in items]
        resources = []
        for m in chosen:
            a = any_pb2.Any()
            a.Pack(m)
            resources.append(a)
        metrics.XDS_PUSHES.labels(type_url.rsplit(".", 1)[-1]).inc()
        return discovery_pb2.DiscoveryResponse(version_info=self.snapshot.versions[type_url], resources=resources,
                                               type_url=type_url, nonce=nonce)
