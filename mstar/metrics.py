"""Every Prometheus metric M* exports, in one place.

Names follow Prometheus conventions: ``mstar_`` prefix, base units in the name
(``_seconds``, ``_bytes``), ``_total`` on counters, histograms for latencies. Each
service process uses the default registry: the gateway serves it on ``GET /metrics`` of
its HTTP port, the conductor and node groups on ``--metrics-port`` (``serve_metrics``).

Hot paths never resolve labels: each service builds a small object below once (per
model, group or link) that holds the labelled children, so an observation is a method
call on a cached child. Gauges that mirror a size (in-flight requests, queue depth) are
read at scrape time (``set_function``) and cost nothing in between.

KV caches: an engine node's ``kv_stats() -> KvStats`` (pages used and free, preemptions
so far) is read at every scrape (``watch_kv``), so the series cost nothing between scrapes.
"""

from __future__ import annotations

import errno
import threading
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from mstar.ports import PortInUse

disable_created_metrics()  # no *_created series: Prometheus does not need them and they double the output

#: seconds: 1 ms .. 5 min, for request-scale latencies
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: seconds: 50 µs .. 2.5 s, for engine steps and gaps between streamed chunks
STEP_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: wall seconds per audio second (below 1: faster than real time)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)

# -- conductor: request lifecycle (label model = the served model) -----------------------
REQUESTS_STARTED = Counter("mstar_requests_started", "Requests admitted by the conductor", ["model"])
REQUESTS_FINISHED = Counter("mstar_requests_finished", "Admitted requests that ended successfully, by finish reason",
                            ["model", "finish_reason"])
REQUESTS_FAILED = Counter("mstar_requests_failed", "Admitted requests that ended with an error, by gRPC status code name "
                          "(CANCELLED: cancelled or the client went away)", ["model", "code"])
REQUESTS_REJECTED = Counter("mstar_requests_rejected", "Requests refused before admission, by gRPC status code name "
                            "(INVALID_ARGUMENT, RESOURCE_EXHAUSTED at the admission limit, NOT_FOUND, ALREADY_EXISTS)",
                            ["model", "code"])
REQUESTS_INFLIGHT = Gauge("mstar_requests_inflight", "Admitted requests not yet ended (the conductor's queue depth)", ["model"])
INFLIGHT_LIMIT = Gauge("mstar_requests_inflight_limit", "The conductor's admission limit (--max-inflight)", ["model"])
REQUEST_DURATION = Histogram("mstar_request_duration_seconds", "End-to-end time of requests that finished OK, "
                             "from arrival at the conductor to the final event", ["model"], buckets=LATENCY_BUCKETS)
FIRST_OUTPUT = Histogram("mstar_time_to_first_output_seconds", "Time from arrival to a request's first output of each "
                         "modality (text: first token, audio: first chunk, image: the image)", ["model", "modality"],
                         buckets=LATENCY_BUCKETS)
AUDIO_OUTPUT = Counter("mstar_audio_output_seconds", "Seconds of audio sent to clients", ["model"])
AUDIO_RTF = Histogram("mstar_audio_real_time_factor", "Per request with audio that finished OK: wall seconds from arrival "
                      "to the end divided by audio seconds produced (below 1: faster than real time)", ["model"],
                      buckets=RTF_BUCKETS)

# -- gateway: HTTP --------------------------------------------------------------------------
HTTP_REQUESTS = Counter("mstar_gateway_requests", "HTTP requests answered by the gateway, by route and status code",
                        ["route", "method", "code"])
HTTP_DURATION = Histogram("mstar_gateway_request_duration_seconds", "Time to answer an HTTP request, body streamed "
                          "to the end included", ["route"], buckets=LATENCY_BUCKETS)
HTTP_INFLIGHT = Gauge("mstar_gateway_inflight_requests", "HTTP requests being answered", ["route"])

# -- node groups (label group = the YAML node group) ------------------------------------------
BATCH_SIZE = Histogram("mstar_node_group_batch_size", "Calls per executed batch (engine nodes: calls an engine step completed)", ["group", "node"],
                       buckets=BATCH_BUCKETS)
STEP_TIME = Histogram("mstar_node_group_step_seconds", "Time of one batch or engine step, routing of its outputs "
                      "included", ["group", "node"], buckets=STEP_BUCKETS)
BUSY = Counter("mstar_node_group_busy_seconds", "Seconds spent executing steps; rate() is the busy fraction", ["group"])
QUEUE_DEPTH = Gauge("mstar_node_group_queue_depth", "Node calls ready and waiting for a batch", ["group"])
GROUP_INFLIGHT = Gauge("mstar_node_group_inflight_requests", "Requests the node group holds state for", ["group"])
REPLICAS_SERVING = Gauge("mstar_node_group_replicas_serving", "Replicas of a node group the conductor routes new requests to",
                         ["group"])
REPLICA_ROUTED = Counter("mstar_node_group_replica_requests", "Requests the conductor pinned to each node-group replica",
                         ["group", "replica"])

# -- edges: tensors leaving a service (src, dst: service names; edge: the graph edge name) ----
EDGE_LABELS = ["src", "dst", "edge", "transport"]
_EDGE_HELP = {
    "mstar_edge_tensors": "Tensors handed to a transport (local: hand-over inside one process, inline: bytes inside the "
                          "gRPC frame, shm: host shared memory, cuda_ipc: CUDA IPC, mooncake: Mooncake transfer engine)",
    "mstar_edge_bytes": "Tensor payload bytes handed to a transport",
    "mstar_edge_transfer_seconds": "Sender-side seconds spent handing tensors to the transport (serialising inline, "
                                   "copying into a pooled buffer; 0 for local)",
}


class _SumsCollector:
    """Counters kept as plain sums per label set and turned into counter families at scrape
    time. For the hottest observations M* makes (one per tensor sent, one per message
    written), where a prometheus_client ``inc`` costs ~1.3 µs each."""

    def __init__(self, help_: dict[str, str], labels: list[str]) -> None:
        self.help, self.labels = help_, labels
        self._lock = threading.Lock()
        self._sums: dict[tuple[str, ...], list] = {}  # label values -> one sum per counter

    def sums(self, *label_values: str) -> list:
        """The live sums of one label set (created at 0), updated by their owner without a lock."""
        with self._lock:
            return self._sums.setdefault(label_values, [0] * len(self.help))

    def collect(self):
        fams = self.describe()
        with self._lock:
            items = [(k, tuple(v)) for k, v in self._sums.items()]
        for labels, values in items:
            for fam, v in zip(fams, values, strict=True):
                fam.add_metric(labels, float(v))
        return fams

    def describe(self):
        return [CounterMetricFamily(name, doc, labels=self.labels) for name, doc in self.help.items()]


class _HistogramSeries:
    """One label set of a ``_FastHistogram``: bucket counts and a sum, updated without a lock
    by one event loop."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, x: float) -> None:
        self.counts[bisect_left(self.bounds, x)] += 1  # le semantics: x <= bound
        self.sum += x


class _FastHistogram:
    """A histogram kept as plain bucket counts per label set and turned into a histogram family
    at scrape time, like ``_SumsCollector``'s counters. For an observation per streamed chunk,
    where a prometheus_client ``observe`` costs ~1.3 µs (a lock per bucket and sum)."""

    def __init__(self, name: str, doc: str, labels: list[str], buckets) -> None:
        self.name, self.doc, self.label_names = name, doc, labels
        self.bounds = [float(b) for b in buckets]
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], _HistogramSeries] = {}

    def labels(self, *label_values: str) -> _HistogramSeries:
        with self._lock:
            series = self._series.get(label_values)
            if series is None:
                series = self._series[label_values] = _HistogramSeries(self.bounds)
            return series

    def collect(self):
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.label_names)
        with self._lock:
            items = [(k, list(v.counts), v.sum) for k, v in self._series.items()]
        for label_values, counts, total in items:
            cumulative, buckets = 0, []
            for bound, n in zip([*self.bounds, float("inf")], counts, strict=True):
                cumulative += n
                buckets.append((_bound_text(bound), cumulative))
            fam.add_metric(list(label_values), buckets, total)
        return [fam]

    def describe(self):
        return [HistogramMetricFamily(self.name, self.doc, labels=self.label_names)]


def _bound_text(bound: float) -> str:
    """A bucket's ``le`` as prometheus_client writes it (``0.005``, ``1.0``, ``+Inf``)."""
    return "+Inf" if bound == float("inf") else repr(bound)


INTER_CHUNK = _FastHistogram("mstar_inter_chunk_seconds", "Time between consecutive outputs of one modality within a "
                             "request", ["model", "modality"], STEP_BUCKETS)
REGISTRY.register(INTER_CHUNK)
_EDGES = _SumsCollector(_EDGE_HELP, EDGE_LABELS)  # [tensors, bytes, seconds]
REGISTRY.register(_EDGES)
#: gRPC messages and frames each service writes to each peer: frames ÷ messages is how well a
#: link coalesces (every message costs ~100 µs of CPU on either side)
_LINKS = _SumsCollector({"mstar_link_messages": "FrameBatch messages written on the stream to a peer",
                         "mstar_link_frames": "Frames written on the stream to a peer (a message carries one or more)"},
                        ["src", "dst"])
REGISTRY.register(_LINKS)

# -- the xDS control plane -----------------------------------------------------------------------
XDS_ENDPOINTS = Gauge("mstar_xds_endpoints", "Endpoints the control plane publishes, by cluster and health",
                      ["cluster", "health"])
XDS_PUSHES = Counter("mstar_xds_pushes", "Discovery responses sent to Envoy, by resource type", ["type"])

# -- KV cache: read from engine nodes at scrape time ----------------------------------------------
@dataclass(frozen=True)
class KvStats:
    """A KV cache's pages now and its preemptions so far (cumulative)."""

    pages_used: int
    pages_free: int
    preemptions: int = 0


class _KvCollector:
    """mstar_kv_pages_used / _free (gauges) and mstar_kv_preemptions_total, by group: the sums
    over the group's engine nodes' ``kv_stats()``, read at every scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, list[Callable[[], KvStats | None]]] = {}

    def watch(self, group: str, source: Callable[[], KvStats | None]) -> None:
        with self._lock:
            self._sources.setdefault(group, []).append(source)

    def collect(self):
        used = GaugeMetricFamily("mstar_kv_pages_used", "KV-cache pages holding sequences", labels=["group"])
        free = GaugeMetricFamily("mstar_kv_pages_free", "KV-cache pages free", labels=["group"])
        pre = CounterMetricFamily("mstar_kv_preemptions", "Sequences preempted (pages freed, recomputed later)",
                                  labels=["group"])
        with self._lock:
            sources = {g: list(s) for g, s in self._sources.items()}
        for group, fns in sources.items():
            stats = [s for s in (fn() for fn in fns) if s is not None]
            if not stats:
                continue
            used.add_metric([group], sum(s.pages_used for s in stats))
            free.add_metric([group], sum(s.pages_free for s in stats))
            pre.add_metric([group], sum(s.preemptions for s in stats))
        return [used, free, pre]

    def describe(self):
        return []  # names are checked against the registry at first collect; no clash possible


_KV = _KvCollector()
REGISTRY.register(_KV)


def watch_kv(group: str, source: Callable[[], KvStats | None]) -> None:
    """Read ``source()`` (an engine node's ``kv_stats``; None: it has no KV cache) at every scrape."""
    _KV.watch(group, source)


# -- per-service helpers with cached children ---------------------------------------------------
class RequestMetrics:
    """The conductor's request metrics for one served model."""

    def __init__(self, model: str, inflight: Callable[[], int], limit: int):
        self.model = model
        self.started = REQUESTS_STARTED.labels(model)
        self.duration = REQUEST_DURATION.labels(model)
        self.audio = AUDIO_OUTPUT.labels(model)
        self.rtf = AUDIO_RTF.labels(model)
        self._first: dict[str, Histogram] = {}
        self._gap: dict[str, _HistogramSeries] = {}
        self._finished: dict[str, Counter] = {}
        self._failed: dict[str, Counter] = {}
        REQUESTS_INFLIGHT.labels(model).set_function(inflight)
        INFLIGHT_LIMIT.labels(model).set(limit)

    def rejected(self, code: str) -> None:
        REQUESTS_REJECTED.labels(self.model, code).inc()  # rare: no cache needed

    def output(self, modality: str, first_s: float | None, gap_s: float | None) -> None:
        if first_s is not None:
            h = self._first.get(modality) or self._first.setdefault(modality, FIRST_OUTPUT.labels(self.model, modality))
            h.observe(first_s)
        if gap_s is not None:
            self.gap(modality).observe(gap_s)

    def gap(self, modality: str) -> _HistogramSeries:
        """The inter-chunk histogram of one modality (observed once per streamed chunk)."""
        h = self._gap.get(modality)
        if h is None:
            h = self._gap[modality] = INTER_CHUNK.labels(self.model, modality)
        return h

    def finished(self, finish_reason: str, total_s: float, audio_s: float) -> None:
        c = self._finished.get(finish_reason) or self._finished.setdefault(
            finish_reason, REQUESTS_FINISHED.labels(self.model, finish_reason))
        c.inc()
        self.duration.observe(total_s)
        if audio_s > 0:
            self.audio.inc(audio_s)
            self.rtf.observe(total_s / audio_s)

    def failed(self, code: str, audio_s: float) -> None:
        c = self._failed.get(code) or self._failed.setdefault(code, REQUESTS_FAILED.labels(self.model, code))
        c.inc()
        if audio_s > 0:
            self.audio.inc(audio_s)


class OutputClock:
    """Per request: when each modality last produced an output (first output, gaps)."""

    __slots__ = ("t0", "last", "_gaps")

    def __init__(self, t0: float):
        self.t0 = t0
        self.last: dict[str, float] = {}
        self._gaps: dict[str, _HistogramSeries] = {}  # this request's modalities' gap histograms

    def tick(self, m: RequestMetrics, modality: str, now: float) -> None:
        last = self.last.get(modality)
        self.last[modality] = now
        if last is None:
            m.output(modality, now - self.t0, None)
            self._gaps[modality] = m.gap(modality)
        else:
            self._gaps[modality].observe(now - last)


class GroupMetrics:
    """A node group's step metrics."""

    def __init__(self, group: str, queue_depth: Callable[[], int], inflight: Callable[[], int]):
        self.group = group
        self.busy = BUSY.labels(group)
        self._nodes: dict[str, tuple[Histogram, Histogram]] = {}
        QUEUE_DEPTH.labels(group).set_function(queue_depth)
        GROUP_INFLIGHT.labels(group).set_function(inflight)

    def step(self, node: str, calls: int, seconds: float) -> None:
        pair = self._nodes.get(node)
        if pair is None:
            pair = self._nodes[node] = (BATCH_SIZE.labels(self.group, node), STEP_TIME.labels(self.group, node))
        if calls:  # an engine step may complete no call (a prefill chunk): no batch to count
            pair[0].observe(calls)
        pair[1].observe(seconds)
        self.busy.inc(seconds)


class EdgeMetrics:
    """Tensors one service sends to one peer (or hands over locally). Observed from the
    service's event loop only (sums are updated without a lock)."""

    def __init__(self, src: str, dst: str):
        self.src, self.dst = src, dst
        self._sums: dict[tuple[str, str], list] = {}

    def sent(self, edge: str, transport: str, nbytes: int, seconds: float) -> None:
        c = self._sums.get((edge, transport))
        if c is None:
            c = self._sums[(edge, transport)] = _EDGES.sums(self.src, self.dst, edge, transport)
        c[0] += 1
        c[1] += nbytes
        c[2] += seconds


def link_counts(src: str, dst: str) -> list[int]:
    """The live [messages, frames] a service's link to ``dst`` has written (updated by the
    link's writer without a lock, like the edge sums)."""
    return _LINKS.sums(src, dst)


def serve_metrics(address: str, port: int) -> int:
    """Serve the default registry on ``http://<host of address>:port/metrics`` (a daemon thread;
    port 0 picks a free one); returns the bound port. ``address`` is the service's ``host:port``."""
    host = address.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
    try:
        httpd, _ = start_http_server(port, addr=host)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        raise PortInUse(f"cannot serve metrics on {host}:{port}: the port is in use; stop that process or pick "
                        "another --metrics-port") from None
    return httpd.server_port


def add_metrics_arg(parser) -> None:
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port at /metrics (0: any free port; default: off)")
