"""Host shared-memory transport with pooled, acknowledged buffers.

Segments live in /dev/shm and are named ``<MSTAR_SHM_PREFIX><owner>-<pid>-<n>`` so a
launcher can remove whatever a crashed service left behind. The sender unlinks its
segments when its link closes; the receiver never unlinks.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading

import numpy as np
import torch

from mstar import wire
from mstar.env import settings
from mstar.services.transport.base import TensorSender
from mstar.v1 import tensor_pb2 as pb

SHM_DIR = "/dev/shm"
SHM_MIN_BYTES = 64 * 1024
_SEGMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
_counter = 0
_counter_lock = threading.Lock()


def _next_name(owner: str) -> str:
    global _counter
    with _counter_lock:
        _counter += 1
        n = _counter
    return f"{settings().shm_prefix}{owner}-{os.getpid()}-{n}"


def _size_class(nbytes: int) -> int:
    size = SHM_MIN_BYTES
    while size < nbytes:
        size *= 2
    return size


class _Segment:
    def __init__(self, name: str, size: int, create: bool):
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name, self.size, self.path = name, size, path
        self.array = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self, unlink: bool) -> None:
        del self.array
        try:
            self.mm.close()
        except BufferError:  # a view is still alive; the mapping goes with it
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ShmSender(TensorSender):
    """Pool of segments for one outgoing link; a segment holds one tensor at a time."""

    def __init__(self, owner: str):
        self.owner = owner
        self._segments: dict[int, _Segment] = {}
        self._free: dict[int, list[int]] = {}  # size class -> segment ids
        self._lock = threading.Lock()

    def encode_into(self, msg: pb.Tensor, name: str, t: torch.Tensor) -> None:
        if t.numel() * t.element_size() < SHM_MIN_BYTES:
            wire.fill_proto(msg, name, t)
            return
        src = wire.tensor_bytes(t)
        n = len(src)
        size = _size_class(n)
        with self._lock:
            free = self._free.setdefault(size, [])
            if free:
                seg_id = free.pop()
                seg = self._segments[seg_id]
            else:
                seg = _Segment(_next_name(self.owner), size, create=True)
                seg_id = len(self._segments) + 1
                while seg_id in self._segments:
                    seg_id += 1
                self._segments[seg_id] = seg
        seg.array[:n] = np.frombuffer(src, dtype=np.uint8)
        msg.name, msg.datatype = name, wire.wire_dtype(t.dtype)
        msg.shape.extend(t.shape)
        msg.shm.segment, msg.shm.offset, msg.shm.nbytes, msg.shm.buffer_id = seg.name, 0, n, seg_id

    def release(self, buffer_ids) -> None:
        with self._lock:
            for seg_id in buffer_ids:
                seg = self._segments.get(seg_id)
                if seg is not None:
                    self._free.setdefault(seg.size, []).append(seg_id)

    def close(self) -> None:
        with self._lock:
            for seg in self._segments.values():
                seg.close(unlink=True)
            self._segments.clear()
            self._free.clear()

    @property
    def segment_names(self) -> list[str]:
        return [s.name for s in self._segments.values()]


def check_segment_name(name: str) -> None:
    """A segment named in a frame is untrusted: only a plain name the mesh's senders make (the
    launch's MSTAR_SHM_PREFIX, no path separators) is ever opened."""
    prefix = settings().shm_prefix
    if not _SEGMENT_NAME.fullmatch(name) or not name.startswith(prefix):
        raise ValueError(f"shared-memory segment {name[:80]!r} is not one this mesh makes (a plain name starting "
                         f"with {prefix!r}); refused")


class ShmReader:
    """Maps segments named in incoming frames (cached) and copies tensors out."""

    def __init__(self) -> None:
        self._open: dict[str, _Segment] = {}

    def read(self, msg: pb.Tensor, acks: list[int]) -> torch.Tensor:
        ref = msg.shm
        seg = self._open.get(ref.segment)
        if seg is None or seg.size < ref.offset + ref.nbytes:
            if seg is not None:
                seg.close(unlink=False)
            check_segment_name(ref.segment)
            st = os.stat(os.path.join(SHM_DIR, ref.segment), follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"shared-memory segment {ref.segment!r} is not a regular file; refused")
            seg = self._open[ref.segment] = _Segment(ref.segment, st.st_size, create=False)
        if ref.offset + ref.nbytes > seg.size:
            raise ValueError(f"shared-memory ref [{ref.offset}, {ref.offset + ref.nbytes}) lies outside segment "
                             f"{ref.segment!r} of {seg.size} bytes")
        try:
            return wire.from_bytes(seg.array[ref.offset : ref.offset + ref.nbytes], msg.datatype, msg.shape)
        finally:
            acks.append(ref.buffer_id)

    def close(self) -> None:
        for seg in self._open.values():
            seg.close(unlink=False)
        self._open.clear()
