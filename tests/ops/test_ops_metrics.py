"""Prometheus metrics of a real mesh: known requests move every service's counters by exactly
the amounts they must, and histograms count exactly the observations they must."""

import base64
import json

import grpc
import pytest
from ops_helpers import Launched, http, scrape, value
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mstar import metrics
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

pytestmark = pytest.mark.e2e
SAMPLE_RATE = 16_000
MODALITY = {cpb.MODALITY_TEXT: "text", cpb.MODALITY_AUDIO: "audio", cpb.MODALITY_LATENT: "latent"}


@pytest.fixture(scope="module")
def mesh():
    m = Launched("serve", "toy", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING").wait_ready()
    yield m
    assert m.stop() == 0, m.stderr(3000)


def scrape_all(mesh) -> dict[str, dict]:
    return {name: scrape(url) for name, url in mesh.metrics.items()}


def test_every_service_is_scraped(mesh):
    assert set(mesh.metrics) == {"gateway", "conductor", "encoder", "decoder", "audio"}
    pages = scrape_all(mesh)
    assert value(pages["conductor"], "mstar_requests_inflight_limit", model="toy") == 1024
    for group in ("encoder", "decoder", "audio"):
        assert ("mstar_node_group_queue_depth", frozenset({("group", group)})) in pages[group]


def test_counters_and_histograms_move_by_exactly_the_requests_sent(mesh):
    before = scrape_all(mesh)
    per_request: list[dict[str, int]] = []  # outputs per modality, one dict per successful request
    audio_s = 0.0

    # 1. REST, streamed, succeeds
    status, body = http("POST", f"{mesh.url}/generate", {"model": "toy", "text": "Hello, World.", "stream": True,
                                                          "model_kwargs": {"max_tokens": 64}})
    assert status == 200
    lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
    assert lines[-1]["type"] == "final"
    chunks = [x for x in lines if x["type"] == "chunk"]
    counts: dict[str, int] = {}
    for c in chunks:
        counts[c["modality"]] = counts.get(c["modality"], 0) + 1
    per_request.append(counts)
    audio_s += sum(len(base64.b64decode(c["data_b64"])) // 2 for c in chunks if c["modality"] == "audio") / SAMPLE_RATE
    rest = {name: sum(1 for c in chunks if c["name"] == name) for name in ("text", "caption", "audio", "levels")}

    # 2. gRPC, succeeds
    with grpc.insecure_channel(mesh.grpc) as ch:
        responses = list(conductor_pb2_grpc.ConductorStub(ch).Generate(cpb.GenerateRequest(model="toy", text="grpc"),
                                                                         timeout=20))
    chunks2 = [c for r in responses for c in r.chunks]
    counts = {}
    for c in chunks2:
        counts[MODALITY[c.modality]] = counts.get(MODALITY[c.modality], 0) + 1
    per_request.append(counts)
    audio_s += sum(len(c.data) // 2 for c in chunks2 if c.modality == cpb.MODALITY_AUDIO) / SAMPLE_RATE
    grpc_counts = {name: sum(1 for c in chunks2 if c.name == name) for name in ("text", "caption", "audio", "levels")}

    # 3. admitted, then fails in the decoder (INTERNAL) before any output
    status, body = http("POST", f"{mesh.url}/generate", {"model": "toy", "text": "abc", "model_kwargs": {"fail_at": 0}})
    assert status == 500 and json.loads(body)["error"]["code"] == "INTERNAL"

    # 4. refused before admission (INVALID_ARGUMENT)
    status, body = http("POST", f"{mesh.url}/generate", {"model": "toy", "text": "hi", "model_kwargs": {"max_tokens": -1}})
    assert status == 400

    after = scrape_all(mesh)

    def delta(service, name, **labels):
        return value(after[service], name, **labels) - value(before[service], name, **labels)

    # conductor: lifecycle
    assert delta("conductor", "mstar_requests_started_total", model="toy") == 3
    assert delta("conductor", "mstar_requests_finished_total", model="toy") == 2
    assert delta("conductor", "mstar_requests_finished_total", model="toy", finish_reason="stop") == 2
    assert delta("conductor", "mstar_requests_failed_total", model="toy") == 1
    assert delta("conductor", "mstar_requests_failed_total", model="toy", code="INTERNAL") == 1
    assert delta("conductor", "mstar_requests_rejected_total", model="toy") == 1
    assert delta("conductor", "mstar_requests_rejected_total", model="toy", code="INVALID_ARGUMENT") == 1
    assert value(after["conductor"], "mstar_requests_inflight", model="toy") == 0
    # conductor: latencies
    assert delta("conductor", "mstar_request_duration_seconds_count", model="toy") == 2
    for modality in ("text", "audio", "latent"):
        assert delta("conductor", "mstar_time_to_first_output_seconds_count", modality=modality) == 2, modality
        gaps = sum(c.get(modality, 0) - 1 for c in per_request)
        assert delta("conductor", "mstar_inter_chunk_seconds_count", modality=modality) == gaps, modality
    assert delta("conductor", "mstar_audio_real_time_factor_count", model="toy") == 2
    assert delta("conductor", "mstar_audio_output_seconds_total", model="toy") == pytest.approx(audio_s)
    # gateway: by route and status (health checks of the launcher go to /health, not /generate)
    assert delta("gateway", "mstar_gateway_requests_total", route="/generate", method="POST", code="200") == 1
    assert delta("gateway", "mstar_gateway_requests_total", route="/generate", code="500") == 1
    assert delta("gateway", "mstar_gateway_requests_total", route="/generate", code="400") == 1
    assert delta("gateway", "mstar_gateway_request_duration_seconds_count", route="/generate") == 3
    assert value(after["gateway"], "mstar_gateway_inflight_requests", route="/generate") == 0
    # node groups: calls executed (sum of batch sizes) and one step time per batch
    decoder_calls = (13 + 1) + (4 + 1) + 1  # a call per byte, one tally; the failing request's one call
    audio_calls = sum(rest[n] + grpc_counts[n] for n in ("audio", "levels", "caption"))
    for group, calls in (("encoder", 3 * 3), ("decoder", decoder_calls), ("audio", audio_calls)):
        assert delta(group, "mstar_node_group_batch_size_sum", group=group) == calls, group
        batches = delta(group, "mstar_node_group_batch_size_count", group=group)
        assert 1 <= batches <= calls and delta(group, "mstar_node_group_step_seconds_count", group=group) == batches
        assert delta(group, "mstar_node_group_busy_seconds_total", group=group) > 0
        assert value(after[group], "mstar_node_group_queue_depth", group=group) == 0
    # edges: the prompt bytes (int64) go inline to the encoder; the decoder hands its generated
    # bytes to its colocated tally without serialising
    prompt_bytes = 8 * (len("Hello, World.") + len("grpc") + len("abc"))
    assert delta("conductor", "mstar_edge_bytes_total", src="conductor", dst="encoder", edge="tokens",
                 transport="inline") == prompt_bytes
    assert delta("conductor", "mstar_edge_tensors_total", src="conductor", dst="encoder", edge="tokens") == 3
    assert delta("decoder", "mstar_edge_bytes_total", src="decoder", dst="decoder", edge="generated",
                 transport="local") == 8 * (13 + 4)
    # the three streams to 'audio' send a frame when the items complete a chunk, and the rest at the end:
    # 13 items: window 8 / stride 4 -> at 8, 12, end; chunks of 4 -> 4, 8, 12, end; chunks of 3 -> 3, 6, 9, 12, end;
    # 4 items: end; 4 (nothing left at the end); 3, end
    assert delta("decoder", "mstar_edge_tensors_total", src="decoder", dst="audio", transport="inline") == (3 + 4 + 5) + (1 + 1 + 2)
    assert delta("decoder", "mstar_edge_transfer_seconds_total", src="decoder", dst="audio", transport="inline") > 0


def test_kv_series_sum_the_engine_nodes_of_a_group():
    """The KV hook on a registry of its own: a group's engine nodes' KvStats are summed at each
    scrape; a node without a KV cache (None) adds nothing. (A served mesh: test_ops_kv_metrics.py.)"""
    registry, kv = CollectorRegistry(), metrics._KvCollector()
    registry.register(kv)
    llm = [metrics.KvStats(3, 5, 2)]
    kv.watch("llm", lambda: llm[0])
    kv.watch("llm", lambda: metrics.KvStats(1, 1))
    kv.watch("llm", lambda: None)
    kv.watch("snac", lambda: metrics.KvStats(7, 1, 4))

    def samples():
        return {(s.name, s.labels["group"]): s.value
                for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}

    assert samples() == {("mstar_kv_pages_used", "llm"): 4, ("mstar_kv_pages_free", "llm"): 6,
                         ("mstar_kv_pages_used", "snac"): 7, ("mstar_kv_pages_free", "snac"): 1,
                         ("mstar_kv_preemptions_total", "llm"): 2, ("mstar_kv_preemptions_total", "snac"): 4}
    llm[0] = metrics.KvStats(0, 8, 3)  # read anew at every scrape
    assert samples()[("mstar_kv_pages_used", "llm")] == 1 and samples()[("mstar_kv_preemptions_total", "llm")] == 3
