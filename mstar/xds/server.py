"""``python -m mstar.xds``: the control plane. It polls its targets (files, DNS) and their
health, rebuilds Envoy's resources and pushes what changed over ADS. It reports SERVING on
grpc.health.v1 once the first poll is done, so Envoy's first answer is already complete."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from envoy.service.discovery.v3 import ads_pb2_grpc

from mstar import metrics
from mstar import tls as mtls
from mstar.services.grpc_server import ServerBase, run_service
from mstar.xds.ads import AdsServicer, Snapshot
from mstar.xds.health import HealthChecker
from mstar.xds.resources import ProxySettings, build
from mstar.xds.targets import Endpoint, TargetsError, TargetSource, resolve

log = logging.getLogger("mstar.xds")
ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"


class ControlPlane:
    def __init__(self, source: TargetSource, settings: ProxySettings, checker: HealthChecker | None = None):
        self.source, self.settings = source, settings
        self.checker = checker or HealthChecker()
        self.snapshot = Snapshot()
        self.health: dict[Endpoint, bool] = {}

    async def poll_once(self) -> list[str]:
        """One round: targets, addresses, health; returns the resource types that changed."""
        try:
            targets = self.source.read()
        except (TargetsError, OSError) as e:
            log.error("keeping the last good targets: %s", e)
            targets = self.source.last
        health = await self.checker.check_all(await resolve(targets))
        self._log_changes(health)
        self.health = health
        return self.snapshot.update(build(health, self.settings))

    def _log_changes(self, health: dict[Endpoint, bool]) -> None:
        for e, ok in health.items():
            if self.health.get(e) != ok:
                log.info("%s %s is %s", e.cluster, e.address, "HEALTHY" if ok else "UNHEALTHY")
        for e in set(self.health) - set(health):
            log.info("%s %s is gone", e.cluster, e.address)
        metrics.XDS_ENDPOINTS.clear()
        for cluster in {e.cluster for e in health}:
            for state in (True, False):
                n = sum(1 for e, ok in health.items() if e.cluster == cluster and ok is state)
                metrics.XDS_ENDPOINTS.labels(cluster, "healthy" if state else "unhealthy").set(n)


class ControlPlaneServer(ServerBase):
    def __init__(self, address: str, plane: ControlPlane):
        super().__init__(address, [ADS_SERVICE])
        self.plane = plane
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(AdsServicer(plane.snapshot), self.server)

    async def run(self, poll_s: float, stop: asyncio.Event) -> None:
        await self.server.start()
        first = True
        while not stop.is_set():
            changed = await self.plane.poll_once()
            if changed:
                log.info("pushing %s", ", ".join(t.rsplit(".", 1)[-1] for t in changed))
            if first:
                await self.set_serving(True)
                first = False
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except TimeoutError:
                pass
        await self.set_serving(False)
        await self.server.stop(grace=0.5)
        await self.plane.checker.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mstar-xds", description="xDS control plane for the M* Envoy front proxy.")
    p.add_argument("--address", default="127.0.0.1:18000", help="host:port the ADS server binds")
    p.add_argument("--targets", required=True, help="JSON file or directory of JSON files listing service targets")
    p.add_argument("--listen", default="0.0.0.0:10000", help="host:port of Envoy's one listener (REST and gRPC)")
    p.add_argument("--poll-interval", type=float, default=2.0, help="seconds between target/health polls")
    p.add_argument("--health-timeout", type=float, default=1.0, help="seconds one health check may take")
    p.add_argument("--request-timeout", type=float, default=300.0, help="longest generate call through Envoy, seconds")
    p.add_argument("--max-generate", type=int, default=256, help="concurrent generate calls per cluster (circuit breaker)")
    p.add_argument("--max-requests", type=int, default=1024, help="concurrent requests on other routes")
    mtls.add_args(p)  # the mesh's certificate, for health checks of 'grpc-mtls' targets
    p.add_argument("--log-level", default="INFO")
    metrics.add_metrics_arg(p)
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    try:  # its ADS port stays plaintext beside Envoy (docs/security.md); TLS is for health checks of node groups
        tls = mtls.from_args(args, {}, "xds control plane", required=False)
    except mtls.TLSError as e:
        log.error("%s", e)
        raise SystemExit(2) from None
    host, _, port = args.listen.rpartition(":")
    settings = ProxySettings(host.strip("[]"), int(port), args.request_timeout, args.max_generate, args.max_requests)
    plane = ControlPlane(TargetSource(args.targets), settings, HealthChecker(args.health_timeout, tls))
    server = ControlPlaneServer(args.address, plane)
    if args.metrics_port is not None:
        log.info("xds metrics on port %d", metrics.serve_metrics(args.address, args.metrics_port))
    log.info("xds control plane on port %d, watching %s", server.port, args.targets)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.run(args.poll_interval, stop)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s [xds] %(name)s: %(message)s")
    run_service(serve(args))
