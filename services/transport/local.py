"""Hand-over between two services of one process: the tensor object itself waits in a
process-wide table and the receiver takes it out (no copy, no serialization).

The sender remembers what it put and not yet got acknowledged; when its link closes
it removes those entries, so a receiver that went away leaks nothing.
"""

from __future__ import annotations

import itertools
import threading

import torch

from mstar import wire
from mstar.services.transport.base import TensorSender, pool_id
from mstar.services.transport.location import PROCESS_TOKEN
from mstar.v1 import tensor_pb2 as pb

_table: dict[int, torch.Tensor] = {}
_lock = threading.Lock()
_ids = itertools.count(1)


def waiting() -> int:
    """Tensors handed over and not yet taken (for leak checks)."""
    return len(_table)


class LocalSender(TensorSender):
    def __init__(self, owner: str):
        self.owner = owner
        self._outstanding: set[int] = set()

    def encode_into(self, msg: pb.Tensor, name: str, t: torch.Tensor) -> None:
        with _lock:
            key = next(_ids)
            _table[key] = t
            self._outstanding.add(key)
        msg.name, msg.datatype = name, wire.wire_dtype(t.dtype)
        msg.shape.extend(t.shape)
        msg.local.buffer_id, msg.local.process = key, PROCESS_TOKEN

    def release(self, buffer_ids) -> None:
        with _lock:
            self._outstanding.difference_update(buffer_ids)

    def close(self) -> None:
        with _lock:
            for key in self._outstanding:
                _table.pop(key, None)
            self._outstanding.clear()


class LocalReader:
    def read(self, msg: pb.Tensor, acks: list[int]) -> torch.Tensor:
        ref = msg.local
        if ref.process != PROCESS_TOKEN:
            raise ValueError(f"tensor '{msg.name}': a local hand-over from another process ({ref.process})")
        with _lock:
            t = _table.pop(pool_id(ref.buffer_id), None)
        if t is None:
            raise ValueError(f"tensor '{msg.name}': local hand-over {ref.buffer_id} is gone (taken twice or its link closed)")
        acks.append(ref.buffer_id)
        return t

    def close(self) -> None:
        pass
