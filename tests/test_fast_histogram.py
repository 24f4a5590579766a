"""mstar.metrics keeps the per-chunk gap histogram as plain counts (_FastHistogram): its scrape
must read exactly as prometheus_client's Histogram fed the same observations."""

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from mstar import metrics


def test_fast_histogram_scrapes_as_prometheus_histogram():
    rng = random.Random(7)
    bounds = metrics.STEP_BUCKETS
    values = [*bounds, 0.0, 1e-9, 99.0, *(rng.choice(bounds) * rng.choice([0.5, 1.0, 1.5]) for _ in range(500))]
    fast = metrics._FastHistogram("t_gap_seconds", "a gap", ["model", "modality"], bounds)
    ref_registry, fast_registry = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("t_gap_seconds", "a gap", ["model", "modality"], buckets=bounds, registry=ref_registry)
    fast_registry.register(fast)
    for i, x in enumerate(values):
        modality = ("text", "audio")[i % 2]
        fast.labels("toy", modality).observe(x)
        ref.labels("toy", modality).observe(x)
    want = [x for x in generate_latest(ref_registry).decode().splitlines() if "_created" not in x]
    assert generate_latest(fast_registry).decode().splitlines() == want


def test_output_clock_counts_first_outputs_and_gaps():
    m = metrics.RequestMetrics("fast-histogram-test", lambda: 0, 1)
    clock = metrics.OutputClock(10.0)
    for now in (10.5, 10.75, 11.0):
        clock.tick(m, "text", now)
    clock.tick(m, "audio", 12.0)
    gaps = m.gap("text")
    assert sum(gaps.counts) == 2 and gaps.sum == 0.5
    assert sum(m.gap("audio").counts) == 0
    first = metrics.FIRST_OUTPUT.labels("fast-histogram-test", "text")
    assert first._sum.get() == 0.5
