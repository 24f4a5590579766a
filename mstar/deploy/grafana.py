"""The Grafana dashboard over M*'s metrics (mstar/metrics.py), generated so that every
query names a metric that exists (tests check it). ``python -m mstar.deploy.grafana OUT``."""

from __future__ import annotations

import json
import sys

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
UID = "mstar-overview"


def _q(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend, "datasource": DATASOURCE}


def _p95(metric: str, by: str = "", q: float = 0.95) -> str:
    by_clause = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({by_clause}) (rate({metric}_bucket[5m])))"


# (title, unit, [(expr, legend)])  — one row of panels per list
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Requests", [
        ("Requests per second by outcome", "reqps", [
            ("sum(rate(mstar_requests_started_total[1m]))", "started"),
            ("sum by (finish_reason) (rate(mstar_requests_finished_total[1m]))", "finished {{finish_reason}}"),
            ("sum by (code) (rate(mstar_requests_failed_total[1m]))", "failed {{code}}"),
            ("sum by (code) (rate(mstar_requests_rejected_total[1m]))", "rejected {{code}}")]),
        ("In flight vs admission limit", "short", [
            ("sum(mstar_requests_inflight)", "in flight"), ("max(mstar_requests_inflight_limit)", "limit")]),
        ("End-to-end latency (OK requests)", "s", [
            (_p95("mstar_request_duration_seconds", q=0.5), "p50"),
            (_p95("mstar_request_duration_seconds"), "p95"),
            (_p95("mstar_request_duration_seconds", q=0.99), "p99")]),
    ]),
    ("Streaming", [
        ("Time to first output p95 by modality", "s", [
            (_p95("mstar_time_to_first_output_seconds", "modality"), "{{modality}}")]),
        ("Inter-chunk latency p95 by modality", "s", [
            (_p95("mstar_inter_chunk_seconds", "modality"), "{{modality}}")]),
        ("Audio: real-time factor and throughput", "short", [
            (_p95("mstar_audio_real_time_factor", q=0.5), "RTF p50 (wall s / audio s)"),
            (_p95("mstar_audio_real_time_factor"), "RTF p95"),
            ("sum(rate(mstar_audio_output_seconds_total[1m]))", "audio seconds per second")]),
    ]),
    ("Gateway", [
        ("HTTP requests per second by status", "reqps", [
            ("sum by (code) (rate(mstar_gateway_requests_total[1m]))", "{{code}}")]),
        ("HTTP latency p95 by route", "s", [(_p95("mstar_gateway_request_duration_seconds", "route"), "{{route}}")]),
        ("HTTP in flight", "short", [("sum by (route) (mstar_gateway_inflight_requests)", "{{route}}")]),
    ]),
    ("Node groups", [
        ("Busy fraction", "percentunit", [
            ("sum by (group) (rate(mstar_node_group_busy_seconds_total[1m]))", "{{group}}")]),
        ("Mean batch size", "short", [
            ("sum by (group, node) (rate(mstar_node_group_batch_size_sum[1m])) / "
             "sum by (group, node) (rate(mstar_node_group_batch_size_count[1m]))", "{{group}}/{{node}}")]),
        ("Step time p95", "s", [(_p95("mstar_node_group_step_seconds", "group, node"), "{{group}}/{{node}}")]),
        ("Queue depth and requests held", "short", [
            ("sum by (group) (mstar_node_group_queue_depth)", "queued {{group}}"),
            ("sum by (group) (mstar_node_group_inflight_requests)", "held {{group}}")]),
        ("Replicas in rotation", "short", [("max by (group) (mstar_node_group_replicas_serving)", "{{group}}")]),
        ("Requests pinned per replica per second", "reqps", [
            ("sum by (group, replica) (rate(mstar_node_group_replica_requests_total[1m]))", "{{group}} {{replica}}")]),
    ]),
    ("KV cache", [
        ("KV pages", "short", [("sum by (group) (mstar_kv_pages_used)", "used {{group}}"),
                               ("sum by (group) (mstar_kv_pages_free)", "free {{group}}")]),
        ("Preemptions per second", "short", [
            ("sum by (group) (rate(mstar_kv_preemptions_total[1m]))", "{{group}}")]),
    ]),
    ("Edges", [
        ("Tensor bytes per second by transport", "Bps", [
            ("sum by (transport) (rate(mstar_edge_bytes_total[1m]))", "{{transport}}")]),
        ("Tensor bytes per second by link", "Bps", [
            ("sum by (src, dst) (rate(mstar_edge_bytes_total[1m]))", "{{src}} → {{dst}}")]),
        ("Mean hand-over time per tensor", "s", [
            ("sum by (transport) (rate(mstar_edge_transfer_seconds_total[1m])) / "
             "sum by (transport) (rate(mstar_edge_tensors_total[1m]))", "{{transport}}")]),
        ("gRPC messages per second and frames per message by link", "short", [
            ("sum by (src, dst) (rate(mstar_link_messages_total[1m]))", "msgs/s {{src}} → {{dst}}"),
            ("sum by (src, dst) (rate(mstar_link_frames_total[1m])) / "
             "sum by (src, dst) (rate(mstar_link_messages_total[1m]))", "frames/msg {{src}} → {{dst}}")]),
    ]),
    ("Front proxy", [
        ("Endpoints published by the control plane", "short", [
            ("sum by (cluster, health) (mstar_xds_endpoints)", "{{cluster}} {{health}}")]),
        ("Envoy upstream requests per second by cluster", "reqps", [
            ("sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_total[1m]))", "{{envoy_cluster_name}}")]),
        ("Envoy circuit breaker overflows", "short", [
            ("sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_pending_overflow[1m]))",
             "{{envoy_cluster_name}}")]),
    ]),
]


def dashboard() -> dict:
    panels, y, pid = [], 0, 1
    for row_title, row in ROWS:
        panels.append({"type": "row", "title": row_title, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        width = 24 // len(row)
        for i, (title, unit, queries) in enumerate(row):
            panels.append({
                "type": "timeseries", "title": title, "id": pid, "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": width, "x": i * width, "y": y},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
                "targets": [{**_q(expr, legend), "refId": chr(ord("A") + k)} for k, (expr, legend) in enumerate(queries)],
            })
            pid += 1
        y += 8
    return {"uid": UID, "title": "M* mesh", "tags": ["mstar"], "timezone": "browser", "schemaVersion": 39,
            "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "editable": True,
            "panels": panels, "templating": {"list": []}, "annotations": {"list": []}}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        f.write(render())
