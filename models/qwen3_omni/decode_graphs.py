"""The Thinker's and the Talker's decode passes (one new token per sequence over the slot cache,
``cache.py``) replayed as CUDA graphs: the runtime's ``LoopGraphs`` with one iteration, a graph
per batch bucket and attention-span bucket, captured on first use. On a CPU, with graphs off or
past the largest bucket the same body runs eagerly.

The body's inputs, one row per sequence: ``slots``, ``lengths`` (tokens already cached),
``positions`` ([B, 3] M-RoPE; the model reads [3, N]), ``count`` (how many rows are real, in every
row) and the model's own (the Thinker's token ids, the Talker's input embeddings). A graph's
padded rows are copies of the last real row; they write their K/V into the cache's scratch slot,
never into a sequence's.

A graph's attention span is static: a step attends ``span_bucket`` keys (max(lengths) + 1 rounded
up to a power of two, at least ``min_span``, at most the cache's max_len), one ``LoopGraphs`` per
span bucket, all sharing one memory pool (an engine runs its passes one at a time). ``Decode``
masks each row's keys past its length, so a longer span changes the work, not the result.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from mstar.models.qwen3_omni.cache import Decode, SlotCache
from mstar.models.qwen3_omni.predictor_loop import batch_buckets
from mstar.services.engines.loop_graph import CaptureFailed, LoopGraphs

log = logging.getLogger(__name__)

#: the shortest span a decode step attends (short sequences share one graph per batch bucket)
MIN_SPAN = 128

#: the model's decode over the body's inputs (positions [3, B]) and a ``Decode`` -> its outputs,
#: one row per input row
Forward = Callable[[dict[str, torch.Tensor], Decode], dict[str, torch.Tensor]]


def span_bucket(longest: int, max_len: int, min_span: int = MIN_SPAN) -> int:
    """Keys a step attends when its longest sequence has ``longest`` tokens cached."""
    return min(max(min_span, 1 << longest.bit_length()), max_len)  # 1 << bit_length: the power of two >= longest + 1


class DecodeGraphs:
    def __init__(self, cache: SlotCache, forward: Forward, device: torch.device | str, max_num_seqs: int,
                 graphs: bool, name: str):
        """``graphs``: replay CUDA graphs (on CUDA; a capture that fails turns them off, logged)."""
        self.cache, self.forward, self.name = cache, forward, name
        self.device = torch.device(device)
        self.graphs = graphs and self.device.type == "cuda"
        self.buckets = batch_buckets(max_num_seqs)
        self.min_span = MIN_SPAN
        self.loops: dict[int, LoopGraphs] = {}  # span -> its graphs
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None

    def run(self, slots: list[int], lengths: list[int], positions: torch.Tensor,
            **model_inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """One new token of each sequence: ``lengths[b]`` tokens of ``slots[b]`` precede row b;
        ``positions`` [3, B]; ``model_inputs`` one row per sequence -> the forward's outputs."""
        longest = max(lengths)
        if longest + 1 > self.cache.max_len:
            raise ValueError(f"sequence of {longest + 1} tokens is longer than the cache's max_len={self.cache.max_len}")
        inputs = self.inputs(slots, lengths, positions, **model_inputs)
        loop = self.loop(self.span(longest))
        try:
            return loop.run(inputs)
        except CaptureFailed as e:  # a CUDA graph capture failed: the same pass, eagerly, from now on
            if not self.graphs:
                raise
            log.warning("%s decode: CUDA graphs off (%s)", self.name, e)
            self.graphs = False
            for each in self.loops.values():
                each.buckets = ()
            return loop.run(inputs)

    def span(self, longest: int) -> int:
        return span_bucket(longest, self.cache.max_len, self.min_span)

    def inputs(self, slots: list[int], lengths: list[int], positions: torch.Tensor,
               **model_inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The body's inputs (host tensors except the model's own)."""
        b = len(slots)
        return {"slots": torch.tensor(slots, dtype=torch.int64), "lengths": torch.tensor(lengths, dtype=torch.int64),
                "positions": positions.t().contiguous(), "count": torch.full((b,), b, dtype=torch.int64), **model_inputs}

    def loop(self, span: int) -> LoopGraphs:
        """The graphs of span bucket ``span`` (made on first use)."""
        loop = self.loops.get(span)
        if loop is None:
            loop = self.loops[span] = LoopGraphs(functools.partial(self._body, span), 1, (), self.device,
                                                 self.buckets if self.graphs else (), f"{self.name}_decode_{span}",
                                                 pool=self._pool)
        return loop

    def _body(self, span: int, s: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        slots = s["slots"]
        real = torch.arange(slots.shape[0], device=slots.device) < s["count"]
        ctx = Decode(self.cache, torch.where(real, slots, self.cache.scratch), s["lengths"], span)
        return self.forward({**s, "positions": s["positions"].t()}, ctx)
