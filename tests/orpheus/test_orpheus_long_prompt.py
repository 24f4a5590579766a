"""Issue 30, finding 6: a long prompt stalled the Orpheus conductor. It was tokenised on the event
loop before its length was checked (30 MB: 43 s, and a small request beside it took 40 s instead
of 0.03 s). Now the conductor refuses a text longer than ``max_prompt_chars`` unread, and reads a
large request on a worker thread with the tokenizer's GIL-releasing ``encode_batch``.

An Orpheus conductor alone (no node group: what it refuses never needs one) on a real gRPC port."""

import asyncio
import threading
import time

import grpc
import pytest

from mstar.conductor.replicas import Replicas
from mstar.conductor.requests import RequestTable
from mstar.conductor.server import INLINE_READ_BYTES, ConductorServer
from mstar.config import Placement, parse_config
from mstar.models.registry import create_model
from mstar.models.tokens import BATCH_FROM_CHARS
from mstar.services.transport import Protocol
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

WAIT_S = 10.0


class SlowTokenizer:
    """The real tokenizer, with a slow ``encode_batch`` that releases the GIL as the real one does."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s
        self.calls: list[tuple[str, int, threading.Thread]] = []

    def encode(self, text, **kw):
        self.calls.append(("encode", len(text), threading.current_thread()))
        return self.inner.encode(text, **kw)

    def encode_batch(self, texts, **kw):
        self.calls.append(("encode_batch", len(texts[0]), threading.current_thread()))
        time.sleep(self.delay_s)
        return self.inner.encode_batch(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def conductor(weights):
    config = parse_config({"model": "orpheus", "max_seq_len": 4096, "node_groups": [{"node_names": ["llm", "snac_decoder"]}]})
    model = create_model("orpheus", {}, weights)
    placement = Placement(config, model)
    model.prepare_conductor()
    model._tokenizer = SlowTokenizer(model._tokenizer, 0.5)
    table = RequestTable(model, placement, Replicas({g: [] for g in config.group_names}), Protocol.TCP)
    return ConductorServer("127.0.0.1:0", table), model._tokenizer


def test_a_long_prompt_is_refused_unread_and_a_large_one_is_read_off_the_loop(weights):
    async def go():
        server, tok = conductor(weights)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = conductor_pb2_grpc.ConductorStub(ch)
                # 30 MB: refused by its length, before any tokenising
                t0 = time.perf_counter()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(cpb.GenerateRequest(model="orpheus", text="a" * (30 << 20)),
                                        timeout=WAIT_S).read()
                refused_s = time.perf_counter() - t0
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details().startswith("text: at most 65536 characters"), e.value.details()
                assert tok.calls == [] and refused_s < 3, (tok.calls, refused_s)
                # a large prompt under the bound: tokenised on a worker thread while the loop answers others
                text = "Hello there. " * (INLINE_READ_BYTES // 10)
                assert BATCH_FROM_CHARS < len(text) < server.servicer.model.max_prompt_chars
                call = asyncio.ensure_future(stub.Generate(cpb.GenerateRequest(model="orpheus", text=text),
                                                           timeout=WAIT_S).read())
                while not tok.calls:
                    await asyncio.sleep(0.005)
                gaps = []
                while not call.done():
                    t = time.perf_counter()
                    await stub.ListModels(cpb.ListModelsRequest(), timeout=WAIT_S)
                    gaps.append(time.perf_counter() - t)
                    await asyncio.sleep(0.01)
                with pytest.raises(grpc.aio.AioRpcError) as e:  # too many tokens for max_seq_len, or no node group
                    await call
                assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE)
                loop_thread = threading.current_thread()
        finally:
            await server.stop(grace_s=0.1)
        return tok.calls, gaps, loop_thread
    calls, gaps, loop_thread = asyncio.run(asyncio.wait_for(go(), 60))
    [(method, _, thread)] = calls
    assert method == "encode_batch" and thread is not loop_thread
    assert len(gaps) >= 5 and max(gaps) < 0.25, gaps  # the loop answered all along the 0.5 s of tokenising
