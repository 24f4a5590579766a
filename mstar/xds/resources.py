"""The Envoy resources (LDS, RDS, CDS, EDS) of an M* front proxy, built from endpoints and
their health. Written as the dicts Envoy's YAML docs show, then parsed into the protobufs.

One listener serves both APIs. gRPC (content-type application/grpc*, or a /mstar.v1. path)
goes to the conductor; everything else to the gateway. Each route class gets its own
cluster over the same endpoints (EDS ``service_name``) so that its circuit breaker is a
per-route concurrency limit. Retries only where a retry cannot run work twice: a request
that never reached an upstream (connect-failure, refused-stream), and idempotent reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401  (registers the Any type)
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format
from google.protobuf.message import Message

from mstar.xds.targets import Endpoint

LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
TYPES = (CLUSTER, ENDPOINT, LISTENER, ROUTE)  # the order Envoy needs them in
ROUTE_NAME = "mstar"
ADS = {"ads": {}, "resource_api_version": "V3"}


@dataclass(frozen=True)
class ProxySettings:
    listen_host: str = "0.0.0.0"
    listen_port: int = 10000
    #: longest a /generate or Generate call may run through the proxy, seconds
    request_timeout_s: float = 300.0
    #: concurrent generate calls Envoy lets through to each of gateway and conductor (circuit breaker)
    max_generate: int = 256
    #: concurrent requests on every other route class
    max_requests: int = 1024
    connect_timeout_s: float = 1.0


def _s(seconds: float) -> str:
    return f"{seconds:.3f}s"


def _cluster(name: str, service: str, grpc: bool, max_requests: int, cfg: ProxySettings) -> dict:
    c = {
        "name": name,
        "type": "EDS",
        "eds_cluster_config": {"eds_config": ADS, "service_name": service},
        "connect_timeout": _s(cfg.connect_timeout_s),
        "lb_policy": "ROUND_ROBIN",
        # An endpoint the control plane marked UNHEALTHY gets no traffic, even if it is the last one
        # (Envoy's default "panic" would spread traffic over unhealthy hosts below 50% healthy).
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "max_connections": max_requests,
                                             "max_pending_requests": max_requests, "max_requests": max_requests,
                                             "max_retries": 8}]},
        # Between two health polls, a host whose connections fail is ejected at once; 5xx answers
        # never eject (a 503 from a gateway is the conductor's state, not the gateway's).
        "outlier_detection": {"split_external_local_origin_errors": True, "consecutive_local_origin_failure": 1,
                              "enforcing_consecutive_local_origin_failure": 100, "enforcing_consecutive_5xx": 0,
                              "enforcing_consecutive_gateway_failure": 0, "enforcing_success_rate": 0,
                              "base_ejection_time": "5s", "interval": "1s", "max_ejection_percent": 100},
    }
    if grpc:
        c["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return c


def _retry(retry_on: str, retries: int = 2, per_try_s: float | None = None) -> dict:
    r = {"retry_on": retry_on, "num_retries": retries,
         "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
             "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
         "host_selection_retry_max_attempts": 3}
    if per_try_s is not None:
        r["per_try_timeout"] = _s(per_try_s)
    return r


NEVER_SENT = "connect-failure,refused-stream,reset-before-request"  # the upstream never saw the request: safe


def routes(cfg: ProxySettings) -> list[dict]:
    long = _s(cfg.request_timeout_s + 10)
    grpc: dict[str, dict] = {"grpc": {}}
    return [
        # the gateway's Prometheus page is for the scraper on the mesh's network, not the public port
        {"name": "no-metrics", "match": {"path": "/metrics"}, "direct_response": {"status": 404}},
        {"name": "grpc-list-models", "match": {"path": "/mstar.v1.Conductor/ListModels", **grpc},
         "route": {"cluster": "conductor", "timeout": "10s",
                   "retry_policy": _retry(NEVER_SENT + ",reset,unavailable", per_try_s=5)}},
        {"name": "grpc-generate", "match": {"path": "/mstar.v1.Conductor/Generate", **grpc},
         "route": {"cluster": "conductor-generate", "timeout": long, "retry_policy": _retry(NEVER_SENT)}},
        {"name": "grpc", "match": {"prefix": "/", **grpc},  # Cancel, health, reflection
         "route": {"cluster": "conductor", "timeout": "60s", "retry_policy": _retry(NEVER_SENT)}},
        {"name": "grpc-by-path", "match": {"prefix": "/mstar.v1."},
         "route": {"cluster": "conductor", "timeout": long, "retry_policy": _retry(NEVER_SENT)}},
        {"name": "rest-generate", "match": {"path": "/generate"},
         "route": {"cluster": "gateway-generate", "timeout": long, "retry_policy": _retry(NEVER_SENT)}},
        {"name": "rest-read", "match": {"prefix": "/", "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
         "route": {"cluster": "gateway", "timeout": "30s",
                   "retry_policy": _retry(NEVER_SENT + ",reset,5xx", per_try_s=10)}},
        {"name": "rest", "match": {"prefix": "/"},
         "route": {"cluster": "gateway", "timeout": long, "retry_policy": _retry(NEVER_SENT)}},
    ]


def listener(cfg: ProxySettings) -> dict:
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "mstar",
        "codec_type": "AUTO",  # HTTP/1.1 for REST clients, h2c (prior knowledge) for gRPC clients
        "rds": {"config_source": ADS, "route_config_name": ROUTE_NAME},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "stream_idle_timeout": "300s",
    }
    return {"name": "mstar",
            "address": {"socket_address": {"address": cfg.listen_host, "port_value": cfg.listen_port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}


def build(health: dict[Endpoint, bool], cfg: ProxySettings) -> dict[str, dict[str, Message]]:
    """Every resource by type URL and name, for endpoints with their health."""
    grpc_clusters = {"conductor"} | {e.cluster for e in health if e.health != "http"}
    logical = sorted({"gateway", "conductor"} | {e.cluster for e in health})
    clusters = [_cluster(c, c, c in grpc_clusters, cfg.max_requests, cfg) for c in logical]
    clusters += [_cluster("gateway-generate", "gateway", "gateway" in grpc_clusters, cfg.max_generate, cfg),
                 _cluster("conductor-generate", "conductor", True, cfg.max_generate, cfg)]
    assignments = []
    for c in logical:
        eps = [{"endpoint": {"address": {"socket_address": {"address": e.ip, "port_value": e.port}}},
                "health_status": "HEALTHY" if ok else "UNHEALTHY"}
               for e, ok in sorted(health.items()) if e.cluster == c]
        assignments.append({"cluster_name": c, "endpoints": [{"lb_endpoints": eps}] if eps else []})
    route_config = {"name": ROUTE_NAME, "virtual_hosts": [{"name": "mstar", "domains": ["*"], "routes": routes(cfg)}]}
    return {
        CLUSTER: {c["name"]: json_format.ParseDict(c, cluster_pb2.Cluster()) for c in clusters},
        ENDPOINT: {a["cluster_name"]: json_format.ParseDict(a, endpoint_pb2.ClusterLoadAssignment()) for a in assignments},
        LISTENER: {"mstar": json_format.ParseDict(listener(cfg), listener_pb2.Listener())},
        ROUTE: {ROUTE_NAME: json_format.ParseDict(route_config, route_pb2.RouteConfiguration())},
    }
