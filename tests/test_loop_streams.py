"""Streams into a running loop (the toy's walk ``duet``): the decoder's loop streams bytes, two a
chunk, into ``echo``, a loop already running beside it. Order, back-pressure, the producer
finishing first, cancellation midway, and the consumer on another node group."""

import asyncio

import grpc
import pytest

from mstar.models.graph import (
    INPUT,
    FixedChunks,
    GraphEdge,
    GraphError,
    GraphNode,
    Loop,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    Walk,
)
from mstar.models.plan import plan_walk
from mstar.models.toy.model import ECHO_AHEAD

from helpers import cancel_and_drain, request, rot13, run, wait_released
from inprocess import inprocess_mesh

TEXT = "Streams, into running loops!"  # 28 bytes: 14 chunks of 2


async def events(stub, req):
    """The stream's chunks in arrival order, as (name, text)."""
    seen = []
    async for r in stub.Generate(req, timeout=30):
        seen += [(c.name, c.text) for c in r.chunks]
    return seen


@pytest.mark.parametrize("placement", ["default", "colocated"], ids=["consumer-on-another-group", "colocated"])
def test_order_back_pressure_and_the_producer_finishing_first(toy_config, placement):
    async def go():
        async with inprocess_mesh(toy_config(placement)) as mesh:
            fast = await events(mesh.stub, request(TEXT, duet=True, echo_tail=3))
            assert "".join(t for n, t in fast if n == "text") == rot13(TEXT)
            echo = [t for n, t in fast if n == "echo"]
            assert "".join(echo) == TEXT + "..."  # every chunk in order, then 3 iterations past the stream's end
            assert len(echo) == len(TEXT) // 2 + 3

            # a slow consumer holds the producer back: never more than ECHO_AHEAD chunks (2 bytes
            # each) untaken, plus the credit that is still on its way back (half a window)
            slow = await events(mesh.stub, request(TEXT, duet=True, echo_delay_ms=15, echo_tail=1))
            lead, echoed, worst = 0, 0, 0
            for name, _ in slow:
                lead += name == "text"
                echoed += name == "echo"
                worst = max(worst, lead - 2 * echoed)
            assert worst <= 2 * (ECHO_AHEAD + ECHO_AHEAD // 2) + 2, slow
            assert lead == len(TEXT)  # ... and it still finishes: the producer ends first
            last_text = max(i for i, (n, _) in enumerate(slow) if n == "text")
            assert [n for n, _ in slow[last_text + 1:]].count("echo") >= 2  # echo runs on after the decoder ended
            await wait_released(mesh)
    run(go(), timeout=90)


def test_cancel_midway_releases_both_loops(toy_config):
    async def go():
        async with inprocess_mesh(toy_config("default")) as mesh:
            call = mesh.stub.Generate(request(TEXT, request_id="duet-cancel", duet=True, echo_delay_ms=50), timeout=30)
            seen = 0
            while seen < 2:  # both loops are running
                r = await call.read()
                seen += sum(c.name == "echo" for c in r.chunks)
            await cancel_and_drain(mesh, call, "duet-cancel")
            # a request after it runs normally on the same groups
            again = await events(mesh.stub, request("ok", duet=True, echo_tail=1))
            assert "".join(t for n, t in again if n == "echo") == "ok."
    run(go(), timeout=60)


def test_a_failing_producer_fails_the_request_and_frees_the_consumer(toy_config):
    async def go():
        async with inprocess_mesh(toy_config("default")) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await events(mesh.stub, request(TEXT, duet=True, fail_at=5, echo_delay_ms=5))
            assert e.value.code() == grpc.StatusCode.INTERNAL and "fail at iteration 5" in e.value.details()
            await wait_released(mesh)
    run(go(), timeout=60)


def _walk(body, *edges):
    nodes = {n: GraphNode(n) for n in ("a", "b", "c")}
    w = Walk("w", body, [GraphEdge(INPUT, "a", "x"), *edges])
    return plan_walk(w, nodes, {"w": w})


def test_graph_rules_for_streams_into_running_loops():
    ok = _walk(Parallel(Loop("a", 4, name="la"), Loop("b", 4, name="lb")), StreamingGraphEdge("a", "b", "s"))
    assert ok.nodes["b"].stream_slot == "s" and [e.name for e in ok.nodes["a"].streams_out] == ["s"]
    assert ok.streams == [] and [e.name for e in ok.loop_streams] == ["s"]
    cases = [
        (Parallel(Loop("b", 4, name="lb"), Loop("a", 4, name="la")), [StreamingGraphEdge("a", "b", "s")], "comes before"),
        (Loop(Sequential("a", "b"), 4), [StreamingGraphEdge("a", "b", "s")], "same loop"),
        (Sequential(Loop("a", 4), "b"), [StreamingGraphEdge("a", "b", "s")], "inside Loops"),
        (Parallel(Loop("a", 4, name="la"), Loop("c", 4, name="lc"), Loop("b", 4, name="lb")),
         [StreamingGraphEdge("a", "b", "s"), StreamingGraphEdge("c", "b", "t")], "two streams"),
    ]
    for body, edges, msg in cases:
        with pytest.raises(GraphError, match=msg):
            _walk(body, *edges)
    with pytest.raises(ValueError, match="max_ahead"):
        StreamingGraphEdge("a", "b", "s", policy=FixedChunks(1), max_ahead=0)


def test_loop_stream_waits_without_spinning(toy_config):
    """While the consumer has caught up, its group does no rounds: it waits on its event."""
    async def go():
        async with inprocess_mesh(toy_config("default")) as mesh:
            audio = mesh.runtime("audio")
            await events(mesh.stub, request("warm", duet=True, echo_tail=1))
            before = audio.steps
            task = asyncio.ensure_future(events(mesh.stub, request("abcdef", duet=True, delay_ms=40, echo_tail=1)))
            await task
            # 3 chunks + 1 tail iteration (+ nothing while waiting 40 ms between decoder bytes)
            assert audio.steps - before <= 4 + 1
    run(go(), timeout=60)
