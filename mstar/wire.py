"""The one place protobuf tensors and torch tensors convert into each other (inline bytes)."""

from __future__ import annotations

import sys

import numpy as np
import torch

from mstar.v1 import tensor_pb2 as pb

_TO_WIRE: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "UINT8", torch.int8: "INT8", torch.int16: "INT16",
    torch.int32: "INT32", torch.int64: "INT64", torch.float16: "FP16", torch.bfloat16: "BF16",
    torch.float32: "FP32", torch.float64: "FP64",
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}
_SPECS = {name: (dt, torch.empty((), dtype=dt).element_size()) for name, dt in _FROM_WIRE.items()}  # dtype, itemsize

assert sys.byteorder == "little", "M* writes tensors little-endian and runs on little-endian hosts"


class WireError(ValueError):
    pass


def wire_dtype(dtype: torch.dtype) -> str:
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot travel; supported: {', '.join(_TO_WIRE.values())}") from None


def torch_dtype(datatype: str) -> torch.dtype:
    try:
        return _FROM_WIRE[datatype]
    except KeyError:
        raise WireError(f"unknown tensor datatype '{datatype}'; supported: {', '.join(_FROM_WIRE)}") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes (contiguous CPU copy only when needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # flat: len() is the byte count at any rank


def fill_proto(msg: pb.Tensor, name: str, t: torch.Tensor) -> None:
    """Write ``t`` inline into ``msg`` (in place: no message copy)."""
    dtype = t.dtype
    msg.name = name
    msg.datatype = _TO_WIRE.get(dtype) or wire_dtype(dtype)
    shape = t.shape
    if len(shape) == 1:
        msg.shape.append(shape[0])
    else:
        msg.shape.extend(shape)
    if t.is_cpu and dtype is not torch.bfloat16 and not t.requires_grad and t.is_contiguous():
        msg.raw = t.numpy().tobytes()  # the common case, one copy
    else:
        msg.raw = bytes(tensor_bytes(t))


def to_proto(name: str, t: torch.Tensor) -> pb.Tensor:
    msg = pb.Tensor()
    fill_proto(msg, name, t)
    return msg


#: below this size a tensor is made over a bytearray copy of its bytes (a few µs); from
#: this size up, copied into a fresh torch allocation (a resizable tensor, faster copy)
SMALL_BYTES = 64 * 1024


def from_bytes(buf, datatype: str, shape) -> torch.Tensor:
    """A tensor of ``shape`` (a sequence of ints, e.g. a message's repeated field) over a copy of ``buf``."""
    spec = _SPECS.get(datatype)
    if spec is None:
        torch_dtype(datatype)  # raises WireError naming the supported datatypes
    dtype, itemsize = spec
    ndim = len(shape)
    if ndim == 1:  # the common case: no list of the message's repeated field
        count = shape[0]
    else:
        shape = list(shape)
        count = 1
        for s in shape:
            count *= s
    nbytes = len(buf)
    if nbytes != count * itemsize:
        raise WireError(f"tensor of shape {list(shape)} {datatype} needs {count * itemsize} bytes, got {nbytes}")
    if 0 < nbytes < SMALL_BYTES:  # one copy, into a bytearray the tensor keeps alive
        out = torch.frombuffer(bytearray(buf), dtype=dtype)
        if ndim == 1:
            return out
        return out.view(*shape) if ndim else out.view(())  # view(*ints): half of view(list)'s cost
    out = torch.empty([count] if ndim == 1 else shape, dtype=dtype)
    if count:  # one copy, straight into memory the tensor owns
        out.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(buf, dtype=np.uint8)
    return out


def from_proto(msg: pb.Tensor) -> torch.Tensor:
    if msg.WhichOneof("payload") != "raw":
        raise WireError(f"tensor '{msg.name}' is not inline; it needs the transport that wrote it")
    return from_bytes(msg.raw, msg.datatype, msg.shape)
