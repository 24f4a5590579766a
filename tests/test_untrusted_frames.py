"""Frames are untrusted input: frames with made-up request ids cannot pile up state in a node
group (issue 30, finding 4: 20,000 forged DATA frames once held 20,000 requests for ever)."""

import torch

from mstar.config import Placement, load_config
from mstar.models.registry import create_model
from mstar.services.node_group import requests as requests_mod
from mstar.services.node_group.runtime import NodeGroupRuntime
from mstar.services.transport import Protocol
from mstar.v1 import node_group_pb2 as pb

K = pb.FrameKind


def runtime():
    cfg = load_config("models/toy/configs/default.yaml")
    model = create_model(cfg.model, cfg.model_kwargs)
    return NodeGroupRuntime("decoder", model, Placement(cfg, model), {}, "127.0.0.1:1", Protocol.TCP)


def data(rid: str) -> pb.Frame:
    f = pb.Frame(kind=K.FRAME_KIND_DATA, request_id=rid, walk="generate", walk_seq=1, chunk_index=-1, parent_walk_seq=-1,
                 node="decoder", edge="text_state", iteration=-1)
    f.tensors.add(name="text_state")
    return f


def feed(rt, frames):
    rt.on_batch(pb.FrameBatch(sender="forger", frames=frames), [[torch.tensor([1, 2, 3])] for _ in frames])


def test_forged_request_ids_are_bounded_and_expire(monkeypatch):
    rt = runtime()
    for i in range(0, 20_000, 500):
        feed(rt, [data(f"forged-{j}") for j in range(i, i + 500)])
    assert len(rt.requests) == requests_mod.MAX_UNSTARTED and rt.requests.dropped == 20_000 - requests_mod.MAX_UNSTARTED
    now = [requests_mod.time.monotonic()]
    monkeypatch.setattr(requests_mod.time, "monotonic", lambda: now[0])
    now[0] += requests_mod.UNSTARTED_TTL_S + 1
    feed(rt, [data("late")])  # anything arriving sweeps what is past its time
    assert list(rt.requests) == ["late"]


def test_a_persisted_value_may_precede_its_walk_start():
    rt = runtime()
    feed(rt, [data("real")])
    start = pb.Frame(kind=K.FRAME_KIND_START_WALK, request_id="real", walk="generate", walk_seq=1, chunk_index=-1,
                     parent_walk_seq=-1, persisted_expected=1, request_kwargs_json='{"max_tokens": 2}')
    rt.on_batch(pb.FrameBatch(sender="conductor", frames=[start]), [[]])
    for i in range(requests_mod.MAX_UNSTARTED + 10):  # forged ones after it do not push it out
        feed(rt, [data(f"forged-{i}")])
    assert "real" in rt.requests and rt.requests["real"].instances


def test_shared_memory_refs_name_only_the_meshs_own_segments(tmp_path):
    """Finding 1: a forged SharedMemoryRef once mapped any file (``../path``) and sent its bytes on."""
    import os

    import pytest

    from mstar.env import settings
    from mstar.services.transport.shm import SHM_DIR, ShmReader
    from mstar.v1 import tensor_pb2

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"do not read")
    link = os.path.join(SHM_DIR, f"{settings().shm_prefix}link-{os.getpid()}")
    os.symlink(secret, link)
    try:
        for name, why in [(f"../..{secret}", "not one this mesh makes"), ("other-prefix-1", "not one this mesh makes"),
                          (f"{settings().shm_prefix}a/../../x", "not one this mesh makes"),
                          (os.path.basename(link), "not a regular file")]:
            msg = tensor_pb2.Tensor(name="t", datatype="UINT8", shape=[4])
            msg.shm.segment, msg.shm.nbytes = name, 4
            with pytest.raises(ValueError, match=why):
                ShmReader().read(msg, [])
    finally:
        os.unlink(link)
