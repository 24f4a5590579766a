"""A served Orpheus mesh exports its KV cache: the LLM group's /metrics carries
mstar_kv_pages_used / _free / mstar_kv_preemptions_total, and pages in use rise while a
request streams and fall back once it ends."""

import time

import grpc
import pytest
from ops_helpers import Launched, scrape, value

from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

pytestmark = pytest.mark.e2e


def kv(url: str) -> tuple[float, float, float]:
    page = scrape(url)
    return (value(page, "mstar_kv_pages_used", group="llm"), value(page, "mstar_kv_pages_free", group="llm"),
            value(page, "mstar_kv_preemptions_total", group="llm"))


def test_kv_series_move_under_load(tmp_path):
    m = Launched("serve", "orpheus", "--random-weights", "--cache-dir", str(tmp_path), "--port", "0",
                 "--grpc-port", "0", "--log-level", "WARNING").wait_ready(timeout=120)
    try:
        url = m.metrics["llm"]
        used0, free0, pre0 = kv(url)
        assert free0 > 0 and pre0 == 0
        with grpc.insecure_channel(m.grpc) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            req = cpb.GenerateRequest(model="orpheus", text="A long one.",
                                      model_kwargs_json='{"max_tokens": 2000, "seed": 1}')  # runs to max_tokens
            stream = stub.Generate(req, timeout=60)
            next(stream)  # audio is flowing: the request holds pages
            used, free, _ = kv(url)
            assert used > used0 and used + free == used0 + free0
            stream.cancel()
        deadline = time.monotonic() + 10
        while kv(url)[0] != used0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kv(url)[:2] == (used0, free0)
    finally:
        assert m.stop() == 0, m.stderr(3000)
