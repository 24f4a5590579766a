"""A Link's deferred frames (``send_later``: a finished request's RELEASE) ride along with the
link's next message, keep their order, and go on their own after ``DEFER_S`` when nothing
else does. A real gRPC peer records each FrameBatch it receives; the link counts what it wrote."""

import asyncio

import grpc

from mstar import metrics
from mstar.services import links as links_mod
from mstar.services.links import Link
from mstar.services.transport import Protocol
from mstar.v1 import node_group_pb2 as pb
from mstar.v1 import node_group_pb2_grpc

from helpers import run

K = pb.FrameKind


class Recorder(node_group_pb2_grpc.NodeGroupServicer):
    def __init__(self):
        self.batches: asyncio.Queue[list[tuple[int, str]]] = asyncio.Queue()

    async def Exchange(self, request_iterator, context):
        async for batch in request_iterator:
            self.batches.put_nowait([(f.kind, f.request_id) for f in batch.frames])
        return
        yield  # a stream-stream handler: an async generator that answers nothing


def frame(kind, rid):
    return pb.Frame(kind=kind, request_id=rid)


def test_deferred_frames_ride_along_keep_order_and_are_not_kept_back_for_long(monkeypatch):
    # 200 ms, not 5: "sent within DEFER_S" below sleeps DEFER_S / 5, and a loaded machine that stalls
    # the loop past the deadline would run the flush before the sleeping test resumes
    monkeypatch.setattr(links_mod, "DEFER_S", 0.2)

    async def main():
        server = grpc.aio.server()
        recorder = Recorder()
        node_group_pb2_grpc.add_NodeGroupServicer_to_server(recorder, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        down = []
        link = Link("links-test", "peer", f"127.0.0.1:{port}", "exchange", Protocol.TCP, lambda *a: down.append(a))
        got = lambda: asyncio.wait_for(recorder.batches.get(), timeout=5)  # noqa: E731
        try:
            # a release queued with other frames goes in their message, after them
            link.send(frame(K.FRAME_KIND_DATA, "a"))
            link.send_later(frame(K.FRAME_KIND_RELEASE, "a"))
            link.send(frame(K.FRAME_KIND_START_WALK, "b"))
            assert await got() == [(K.FRAME_KIND_DATA, "a"), (K.FRAME_KIND_START_WALK, "b"),
                                   (K.FRAME_KIND_RELEASE, "a")]
            # alone, it waits DEFER_S for company, then goes by itself
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            link.send_later(frame(K.FRAME_KIND_RELEASE, "b"))
            assert await got() == [(K.FRAME_KIND_RELEASE, "b")]
            assert loop.time() - t0 >= links_mod.DEFER_S * 0.9
            # a frame sent within DEFER_S takes it along: one message, the release last
            link.send_later(frame(K.FRAME_KIND_RELEASE, "c"))
            await asyncio.sleep(links_mod.DEFER_S / 5)
            link.send(frame(K.FRAME_KIND_START_WALK, "d"))
            assert await got() == [(K.FRAME_KIND_START_WALK, "d"), (K.FRAME_KIND_RELEASE, "c")]
            await asyncio.sleep(3 * links_mod.DEFER_S)  # the timer it cancelled sends nothing more
            assert recorder.batches.empty() and not down
            assert metrics.link_counts("links-test", "peer") == [3, 6]  # what mstar_link_messages/_frames export
        finally:
            await link.close()
            await server.stop(0)

    run(main())


def test_batch_bytes_is_the_frame_batch_serialized():
    """Links write each message as bytes built frame by frame (no copy of the frames into a
    FrameBatch): the very bytes FrameBatch.SerializeToString writes, at every length prefix size."""
    for n in (0, 1, 100, 127, 128, 16383, 16384, 1 << 21):
        frames = [pb.Frame(kind=K.FRAME_KIND_DATA, request_id="r" * n, iteration=-1),
                  pb.Frame(kind=K.FRAME_KIND_START_WALK, walk="w", routes={"g": "h:1"}, persisted_sent={"g": 2}),
                  pb.Frame()]
        frames[0].tensors.add(name="x", datatype="UINT8", shape=[3], raw=b"abc")
        want = pb.FrameBatch(sender="links-test", frames=frames)
        got = links_mod.batch_bytes(links_mod._sender_field("links-test"), frames)
        assert got == want.SerializeToString(), n
        assert pb.FrameBatch.FromString(got) == want
    assert links_mod.batch_bytes(links_mod._sender_field(""), []) == b""
