"""Chunkers: cut a streaming edge into chunks under its chunk policy (``graph.py``'s
FixedChunks, SlidingWindow, LeftContext).

The node group's runtime cuts every served stream with it; model code that must cut a stream
exactly as served (a reference decode, a test) uses the same class from here, the model-author
package, and never the node group's internals.

A stream is a sequence of rows (dim 0): each producer iteration appends its value's
rows — usually one, possibly none (nothing worth streaming this step) or several.
Policies count rows. Only the rows a future chunk can still need are kept.

A sender across a link runs a counting Chunker (``keep_rows=False``) as a shadow of the
receiver's: rows the receiver cannot cut a chunk from yet are held back and go out in one
frame with the rows that complete the next chunk, so a stream of one row per iteration
costs one frame per chunk, not one per row, and reaches the consumer no later.
"""

from __future__ import annotations

import torch

from mstar.models.base import ChunkInfo
from mstar.models.graph import ChunkPolicy, FixedChunks, LeftContext, SlidingWindow

Chunk = tuple[ChunkInfo, torch.Tensor]


class Chunker:
    def __init__(self, policy: ChunkPolicy, keep_rows: bool = True):
        """``keep_rows=False``: count only; chunks come back without tensors."""
        self.policy, self.keep_rows = policy, keep_rows
        self.rows: torch.Tensor | None = None  # rows [base, count) of the stream
        self.base = 0  # stream position of rows[0]
        self.count = 0  # rows received
        self.covered = 0  # items delivered as "new" in some chunk
        self.chunks = 0
        self.closed = False

    def _emit(self, start: int, end: int, final: bool) -> Chunk:
        info = ChunkInfo(index=self.chunks, start=start, new_from=self.covered, final=final)
        self.chunks += 1
        self.covered = end
        if not self.keep_rows:
            return info, None  # type: ignore[return-value]
        assert self.rows is not None
        return info, self.rows[start - self.base : end - self.base]

    def _trim(self, keep_from: int) -> None:
        if keep_from > self.base and self.rows is not None:
            self.rows = self.rows[keep_from - self.base :]
            self.base = keep_from

    def push(self, item: torch.Tensor) -> list[Chunk]:
        if self.closed:
            raise RuntimeError("item after the stream ended")
        if item.dim() == 0:
            item = item.reshape(1)
        if self.keep_rows:
            self.rows = item if self.rows is None else torch.cat([self.rows, item])
        self.count += item.shape[0]
        return self._ready(final=False)

    def finish(self) -> list[Chunk]:
        self.closed = True
        return self._ready(final=True)

    def _ready(self, final: bool) -> list[Chunk]:
        p, out = self.policy, []
        if isinstance(p, FixedChunks):
            while self.count - self.covered >= p.size:
                start = self.covered
                out.append(self._emit(start, start + p.size, final=False))
            if final and self.count > self.covered and p.continue_after_done:
                out.append(self._emit(self.covered, self.count, final=True))
            self._trim(self.covered)
        elif isinstance(p, SlidingWindow):
            # first window when `first` items exist (default `window`), then every `stride` new items
            # (ramp: at most as many new items as already covered)
            while True:
                n = (min(p.stride, self.covered) if p.ramp else p.stride) if self.chunks else p.first_rows
                if self.count - self.covered < n:
                    break
                end = self.covered + n
                out.append(self._emit(max(0, end - p.window), end, final=False))
            if final and self.count:  # always a last window, so a look-ahead consumer can flush
                out.append(self._emit(max(0, self.count - p.window), self.count, final=True))
            self._trim(max(0, self.covered - p.window))
        elif isinstance(p, LeftContext):
            while self.count - self.covered >= p.chunk:
                start = self.covered
                out.append(self._emit(max(0, start - p.left_context), start + p.chunk, final=False))
            if final and self.count > self.covered:
                out.append(self._emit(max(0, self.covered - p.left_context), self.count, final=True))
            self._trim(max(0, self.covered - p.left_context))
        else:
            raise TypeError(f"unknown chunk policy {p!r}")
        if final and out:
            info, t = out[-1]
            out[-1] = (ChunkInfo(info.index, info.start, info.new_from, True), t)
        return out
