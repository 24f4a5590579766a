"""Wire conversion and the shared-memory transport."""

import glob

import pytest
import torch

from mstar import wire
from mstar.env import settings
from mstar.services.transport import TensorReceiver
from mstar.services.transport.shm import SHM_MIN_BYTES, ShmSender
from mstar.v1 import tensor_pb2 as pb


def encode(sender, name, t):
    msg = pb.Tensor()
    sender.encode_into(msg, name, t)
    return msg


def test_non_contiguous_and_bf16_tensors_travel():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(wire.from_proto(wire.to_proto("t", t)), t)
    b = torch.randn(5, dtype=torch.bfloat16)
    assert torch.equal(wire.from_proto(wire.to_proto("b", b)), b)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_inline_roundtrip_every_dtype(dtype):
    t = (torch.randn(3, 5) * 10).to(dtype)
    msg = wire.to_proto("x", t)
    assert msg.datatype == wire.wire_dtype(dtype) and list(msg.shape) == [3, 5]
    back = wire.from_proto(msg)
    assert back.dtype == dtype and torch.equal(back, t)


def test_inline_rejects_wrong_byte_count():
    msg = wire.to_proto("x", torch.zeros(4))
    msg.shape[:] = [5]
    with pytest.raises(wire.WireError, match="needs 20 bytes, got 16"):
        wire.from_proto(msg)


def test_shm_roundtrip_pools_and_frees():
    sender, receiver = ShmSender("test"), TensorReceiver()
    big = torch.randn(SHM_MIN_BYTES // 2, dtype=torch.float32)  # 128 KiB
    acks: list[int] = []
    msg = encode(sender, "big", big)
    assert msg.WhichOneof("payload") == "shm"
    assert torch.equal(receiver.decode(msg, acks), big)
    assert acks == [msg.shm.buffer_id]
    sender.release(acks)
    msg2 = encode(sender, "big", big * 2)
    assert msg2.shm.segment == msg.shm.segment  # the acknowledged buffer is reused
    assert torch.equal(receiver.decode(msg2, []), big * 2)
    msg3 = encode(sender, "big", big * 3)  # msg2 not acknowledged: a second segment
    assert msg3.shm.segment != msg.shm.segment
    small = encode(sender, "small", torch.arange(10))
    assert small.WhichOneof("payload") == "raw"
    names = sender.segment_names
    assert all(glob.glob(f"/dev/shm/{n}") for n in names)
    sender.close()
    receiver.close()
    assert not any(glob.glob(f"/dev/shm/{n}") for n in names)
    assert all(n.startswith(settings().shm_prefix) for n in names)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.bfloat16])
def test_shm_carries_multi_dimensional_tensors_of_any_dtype(dtype):
    """An image's [3, H, W] uint8 pixels once went as 3 bytes (the byte count was len() of a
    3-D memoryview: its first dimension)."""
    sender, receiver = ShmSender("test"), TensorReceiver()
    t = (torch.rand(3, 256, 192) * 255).to(dtype)
    msg = encode(sender, "pixels", t)
    assert msg.WhichOneof("payload") == "shm" and msg.shm.nbytes == t.numel() * t.element_size()
    assert torch.equal(receiver.decode(msg, []), t)
    sender.close()
    receiver.close()


def test_timing_settings_are_checked(monkeypatch):
    settings.cache_clear()
    try:
        monkeypatch.setenv("MSTAR_GIL_SWITCH_INTERVAL_S", "0.0001")
        assert settings().gil_switch_interval_s == 0.0001
        settings.cache_clear()
        monkeypatch.setenv("MSTAR_GIL_SWITCH_INTERVAL_S", "fast")
        with pytest.raises(ValueError, match="MSTAR_GIL_SWITCH_INTERVAL_S must be a positive number of seconds, got 'fast'"):
            settings()
        monkeypatch.delenv("MSTAR_GIL_SWITCH_INTERVAL_S")
        settings.cache_clear()
        monkeypatch.delenv("MSTAR_ROUND_BUDGET_S", raising=False)
        assert settings().round_budget_s == 0.0  # off unless set: yield after every round
        for raw, want in (("0", 0.0), ("0.002", 0.002)):
            settings.cache_clear()
            monkeypatch.setenv("MSTAR_ROUND_BUDGET_S", raw)
            assert settings().round_budget_s == want
        settings.cache_clear()
        monkeypatch.setenv("MSTAR_ROUND_BUDGET_S", "-1")
        with pytest.raises(ValueError, match="MSTAR_ROUND_BUDGET_S must be a number of seconds >= 0, got '-1'"):
            settings()
    finally:
        monkeypatch.undo()
        settings.cache_clear()
