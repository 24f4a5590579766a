"""AUTO transport choice: per tensor, from where the receiving service runs."""

import torch

from mstar.services.transport import LinkSender, Protocol, TensorReceiver, TensorSender
from mstar.services.transport import local as local_transport
from mstar.services.transport.base import MIN_REF_BYTES, MOONCAKE_MIN_BYTES
from mstar.services.transport.location import PROCESS_TOKEN, host_id, local_location
from mstar.v1 import node_group_pb2 as pb
from mstar.v1 import tensor_pb2

BIG = torch.zeros(MIN_REF_BYTES // 4, dtype=torch.float32)
SMALL = torch.zeros(4)


def sender(peer: pb.Location | None, protocol=Protocol.AUTO) -> LinkSender:
    s = LinkSender(protocol, "test")
    if peer is not None:
        s.set_peer(peer)
    return s


def test_choice_by_location():
    same_proc = local_location("peer")
    same_host = pb.Location(service="peer", host_id=host_id(), process="other")
    same_host_gpu = pb.Location(service="peer", host_id=host_id(), process="other", gpu_uuids=["GPU-x"])
    other = pb.Location(service="peer", host_id="elsewhere", process="other")
    other_mc = pb.Location(service="peer", host_id="elsewhere", process="other", mooncake_protocol="tcp")
    assert sender(None).pick(BIG) == "inline"  # location not known yet
    assert sender(same_proc).pick(SMALL) == sender(same_proc).pick(BIG) == "local"
    assert sender(same_host).pick(BIG) == "shm" and sender(same_host).pick(SMALL) == "inline"
    assert sender(same_host_gpu).pick(BIG) == "shm", "a CPU tensor goes through host memory even to a GPU peer"
    assert sender(other).pick(BIG) == "inline"
    from mstar.services.transport import mooncake

    huge = torch.zeros(MOONCAKE_MIN_BYTES, dtype=torch.uint8)
    assert sender(other_mc).pick(huge) == ("mooncake" if mooncake.available() else "inline")
    assert sender(other_mc).pick(BIG) == "inline", "small tensors cross hosts inline (faster than a Mooncake read)"
    assert "other host" in sender(other).describe() and "no Mooncake" in sender(other).describe()
    # a forced protocol wins over the location
    assert sender(same_proc, Protocol.TCP).pick(BIG) == "inline"
    assert sender(other, Protocol.SHM).pick(BIG) == "shm"


def test_local_hand_over_is_the_object_and_leaks_nothing():
    s, r = sender(local_location("peer")), TensorReceiver()
    t = torch.arange(10)
    msg, acks = tensor_pb2.Tensor(), []
    assert s.encode_into(msg, "x", t) == "local" and msg.local.process == PROCESS_TOKEN
    assert r.decode(msg, acks) is t and len(acks) == 1
    s.release(acks)
    msg2 = tensor_pb2.Tensor()
    s.encode_into(msg2, "y", t)
    assert local_transport.waiting() >= 1
    s.close()  # never taken: the link's close drops it
    assert local_transport.waiting() == 0


def test_in_process_mesh_hands_tensors_over(toy_config):
    from prometheus_client import REGISTRY

    from helpers import collect, request, rot13, run, text_of
    from inprocess import inprocess_mesh

    def handed(kind):
        return sum(s.value for f in REGISTRY.collect() if f.name == "mstar_edge_tensors" for s in f.samples
                   if s.name.endswith("_total") and s.labels.get("transport") == kind and s.labels["src"] != s.labels["dst"])

    async def main():
        async with inprocess_mesh(toy_config(), Protocol.AUTO) as mesh:
            await collect(mesh.stub, request("warm"))  # a link's first frames go inline until the peer says where it is
            before = handed("local")
            out, _ = await collect(mesh.stub, request("abc"))
            assert text_of(out["text"]) == rot13("abc")
            assert handed("local") > before
    run(main())


def test_big_pooled_payloads_are_decoded_off_the_event_loop():
    """A big shared-memory read must not stall the service's loop (other streams, health)."""
    import asyncio
    import threading

    from mstar.services.transport.base import OFFLOAD_BYTES
    from mstar.services.transport.shm import ShmSender

    from helpers import run

    sender, receiver = ShmSender("offload-test"), TensorReceiver()
    try:
        def batch(nbytes: int) -> pb.FrameBatch:
            f = pb.Frame(request_id="r")
            sender.encode_into(f.tensors.add(), "x", torch.arange(nbytes, dtype=torch.uint8))
            return pb.FrameBatch(sender="s", frames=[f])

        big, small = batch(OFFLOAD_BYTES), batch(MIN_REF_BYTES)
        assert TensorReceiver.slow_bytes(big) == OFFLOAD_BYTES and TensorReceiver.slow_bytes(small) == MIN_REF_BYTES
        threads = []
        real = receiver.decode_frames

        def spy(*args):
            threads.append(threading.current_thread() is threading.main_thread())
            return real(*args)

        receiver.decode_frames = spy

        async def main():
            acks: list[int] = []
            (got,), = await receiver.decode_batch_async(big, acks)
            assert torch.equal(got, torch.arange(OFFLOAD_BYTES, dtype=torch.uint8)) and len(acks) == 1
            await receiver.decode_batch_async(small, acks)
            await asyncio.sleep(0)
        run(main())
        assert threads == [False, True], "big batch on a worker thread, small one inline"
    finally:
        receiver.close()
        sender.close()


def test_a_frame_that_cannot_be_decoded_fails_its_request_only(toy_config):
    import grpc

    from mstar.conductor.replicas import Replicas
    from mstar.conductor.requests import ActiveRequest, Failure, RequestTable
    from mstar.config import Placement
    from mstar.models.base import RequestState
    from mstar.models.registry import create_model

    good, bad = pb.Frame(request_id="other"), pb.Frame(request_id="r1")
    good.tensors.add().CopyFrom(_inline("x", torch.arange(3)))
    bad.tensors.add().local.buffer_id = 12345  # a hand-over from another process: refused
    batch = pb.FrameBatch(sender="decoder", frames=[bad, good])
    decoded = TensorReceiver().decode_batch(batch, [])
    assert isinstance(decoded[0], ValueError) and torch.equal(decoded[1][0], torch.arange(3))

    config = toy_config()
    model = create_model(config.model, config.model_kwargs)
    table = RequestTable(model, Placement(config, model), Replicas({g: [] for g in config.group_names}), Protocol.TCP)
    ar = table.active["r1"] = ActiveRequest("r1", RequestState(prompt=None), "{}", 0.0)
    table.on_batch(batch, decoded)
    event = ar.events.get_nowait()
    assert isinstance(event, Failure) and event.code == grpc.StatusCode.INTERNAL
    assert "cannot decode a tensor sent by 'decoder'" in event.message and "another process" in event.message


def _inline(name, t):
    msg = tensor_pb2.Tensor()
    TensorSender().encode_into(msg, name, t)
    return msg


def test_a_request_without_a_route_to_a_group_fails_unavailable(toy_config):
    import grpc
    import pytest

    from mstar.config import Placement
    from mstar.models.registry import create_model
    from mstar.services.node_group.requests import RequestFailed
    from mstar.services.node_group.runtime import NodeGroupRuntime

    config = toy_config()
    model = create_model(config.model, config.model_kwargs)
    router = NodeGroupRuntime("encoder", model, Placement(config, model), {}, "127.0.0.1:1", Protocol.TCP)

    class Req:
        routes: dict = {}

    with pytest.raises(RequestFailed) as e:
        router.routes.link(Req.routes, "decoder")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no replica of node group 'decoder' is known to 'encoder'" in e.value.message
    Req.routes = {"decoder": "127.0.0.1:3"}
    assert router.routes.link(Req.routes, "decoder").address == "127.0.0.1:3"
    Req.routes = {"decoder": "127.0.0.1:1"}  # the conductor's address: a route cannot relabel a known peer (issue 30)
    with pytest.raises(RequestFailed, match="which is a replica of 'conductor'"):
        router.routes.link(Req.routes, "decoder")
