"""The stateless engine: batches calls at one node that keep no per-request cache
(encoders, VAE decoders, audio codecs).

Calls are grouped by shape bucket: each item ([length, ...]) is zero-padded along its first
dim to a length bucket, items of one padded shape are stacked, and the batch is zero-padded
to a batch-size bucket, so the function sees few distinct shapes. Optional ``torch.compile``;
on CUDA, optional graph capture and replay per (batch bucket, item shape).

The function must treat batch rows independently and, when length buckets are used, map
[B, L, ...] to [B, L, ...] without letting padding change the real positions (a pointwise
or length-masked function); outputs are cut back to each item's length.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mstar.services.engines.batch import h2d

log = logging.getLogger(__name__)


@dataclass
class StatelessStats:
    calls: int = 0  # items run
    batches: int = 0  # function invocations (eager or replayed)
    padded_rows: int = 0  # batch rows added to reach a bucket
    graph_replays: int = 0


class StatelessEngine:
    def __init__(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
        length_buckets: Sequence[int] | None = None,
        compile: bool = False,
        compile_backend: str = "inductor",
        cuda_graphs: bool = False,
        device: torch.device | str = "cpu",
    ):
        self.device = torch.device(device)
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.length_buckets = tuple(sorted(set(length_buckets))) if length_buckets else None
        self.fn = torch.compile(fn, backend=compile_backend, dynamic=False) if compile else fn
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        if cuda_graphs and not self.cuda_graphs:
            log.info("CUDA graphs off: device is %s, not CUDA", self.device)
        self.stats = StatelessStats()
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def padded_length(self, length: int) -> int:
        if self.length_buckets is None:
            return length
        return next((b for b in self.length_buckets if b >= length), length)

    def batch_bucket(self, n: int) -> int:
        return next((b for b in self.batch_sizes if b >= n), n)

    @torch.inference_mode()
    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One output per input, in order."""
        groups: dict[tuple, list[int]] = {}
        for i, x in enumerate(inputs):
            key = (self.padded_length(x.shape[0]), *x.shape[1:], x.dtype)
            groups.setdefault(key, []).append(i)
        outputs: list[torch.Tensor | None] = [None] * len(inputs)
        step = self.batch_sizes[-1]
        for key, idx in groups.items():
            for lo in range(0, len(idx), step):
                part = idx[lo : lo + step]
                outs = self._run_group([inputs[i] for i in part], key[0])
                for i, o in zip(part, outs, strict=True):
                    outputs[i] = o
        self.stats.calls += len(inputs)
        return outputs  # type: ignore[return-value]

    def _run_group(self, items: list[torch.Tensor], length: int) -> list[torch.Tensor]:
        n, bucket = len(items), self.batch_bucket(len(items))
        host = all(x.device.type == "cpu" for x in items)  # then pad on the host and copy once
        batch = items[0].new_zeros((bucket, length, *items[0].shape[1:]), device="cpu" if host else self.device)
        for row, x in enumerate(items):
            batch[row, : x.shape[0]] = x if host else x.to(self.device)
        if host:
            batch = h2d(batch, self.device)
        out = self._call(batch)
        self.stats.batches += 1
        self.stats.padded_rows += bucket - n
        if self.length_buckets is None:
            return [out[row] for row in range(n)]
        return [out[row, : x.shape[0]] for row, x in enumerate(items)]

    def _call(self, batch: torch.Tensor) -> torch.Tensor:
        if not self.cuda_graphs:
            return self.fn(batch)
        key = (tuple(batch.shape), batch.dtype)
        if key not in self._graphs:
            self._graphs[key] = self._capture(batch)
        graph, static_in, static_out = self._graphs[key]
        static_in.copy_(batch)
        graph.replay()
        self.stats.graph_replays += 1
        return static_out.clone()  # the next replay overwrites static_out

    def _capture(self, batch: torch.Tensor):
        static_in = batch.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.fn(static_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.fn(static_in)
        return graph, static_in, static_out
