"""Host-side inputs of one forward pass over the paged cache.

Built from the cache's page lists before the pass; all CPU work, so an engine can build step
N+1's inputs while step N runs on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mstar.services.engines.attention import AttentionBatch
from mstar.services.engines.kv_cache import PagedKVCache
from mstar.services.engines.pages import build_csr, pages_for

#: Padded rows of a CUDA-graph batch attend to, and write into, slot 0 of scratch page 0.
SCRATCH_PAGE = 0


def h2d(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor to ``device`` without waiting for queued device work (a plain ``.to`` from
    pageable memory synchronises the stream, which would stall a pipelined decode)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


_SIDE_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, role) not in _SIDE_STREAMS:
        _SIDE_STREAMS[(index, role)] = torch.cuda.Stream(device=torch.device("cuda", index))
    return _SIDE_STREAMS[(index, role)]


def upload_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's stream for a decode step's input copies, kept off the compute stream: each
    copy between kernels there costs the step the copy and two engine switches (~5 µs on an H100,
    bench/results/engines/2026-11-25d/). Copies on it only go into persistent buffers: nothing is
    allocated on it."""
    return _side_stream(device, "upload")


def download_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's stream for sampled tokens' copies to the host, off the compute stream for the
    same reason (``upload_stream``); separate from it, so the next step's uploads never queue
    behind a download that waits for this step's sampler."""
    return _side_stream(device, "download")


class StagedRows:
    """Per-step numbers (a host array) uploaded ahead of the kernels that read them, off the
    compute stream: into one of ``copies`` persistent device buffers on ``upload_stream``, which
    the compute stream waits for where ``put`` is called. Call ``put`` before the step's forward
    pass, so the copy runs meanwhile, and ``read`` once the kernels that read it are queued; a
    buffer is rewritten only after its last reader ran. On a CPU, a plain copy."""

    def __init__(self, device: torch.device, copies: int = 2):
        self.device = device
        self._bufs: list[torch.Tensor | None] = [None] * copies
        self._done = [torch.cuda.Event() for _ in range(copies)] if device.type == "cuda" else []
        self._turn = 0

    def put(self, host: np.ndarray) -> torch.Tensor:
        """``host`` (float64 or int64) on the device, same shape; read it before the next ``put``
        but one (``copies`` = 2)."""
        src = torch.from_numpy(np.ascontiguousarray(host))
        if self.device.type != "cuda":
            return h2d(src, self.device)
        self._turn = (self._turn + 1) % len(self._bufs)
        i = self._turn
        main, up = torch.cuda.current_stream(self.device), upload_stream(self.device)
        buf = self._bufs[i]
        if buf is None or buf.numel() < src.numel() or buf.dtype != src.dtype:
            buf = self._bufs[i] = torch.empty(max(src.numel(), 64), dtype=src.dtype, device=self.device)
            up.wait_stream(main)  # a fresh block may be one that main's queued kernels still read
        else:
            up.wait_event(self._done[i])  # its previous readers ran
        dst = buf[: src.numel()].view(src.shape)
        with torch.cuda.stream(up):
            dst.copy_(src.pin_memory(), non_blocking=True)
        main.wait_stream(up)
        return dst

    def read(self) -> None:
        """The kernels reading the latest ``put`` are queued on the compute stream."""
        if self._done:
            self._done[self._turn].record(torch.cuda.current_stream(self.device))


@dataclass(frozen=True)
class SeqSlice:
    """New tokens of one labelled sequence in a forward pass: cache positions [start, start + num_tokens)."""

    request_id: str
    label: str
    start: int
    num_tokens: int


@dataclass(frozen=True)
class StepInputs:
    slices: tuple[SeqSlice, ...]
    positions: torch.Tensor  # int64 [num_rows]: RoPE positions (padded rows: 0)
    attn: AttentionBatch
    page_lists: tuple[tuple[int, ...], ...]  # pages each slice's attention reads
    num_rows: int  # real token rows; rows past it pad a CUDA-graph batch

    @property
    def padded_rows(self) -> int:
        return self.attn.num_tokens

    def last_rows(self) -> torch.Tensor:
        """Row of each slice's last token (whose logits a sampler wants)."""
        ends = self.attn.qo_indptr[1 : len(self.slices) + 1].long() - 1
        return ends


def build_step_inputs(
    cache: PagedKVCache,
    slices: Sequence[SeqSlice],
    causal: bool = True,
    positions: torch.Tensor | None = None,
    pad_to: int | None = None,
) -> StepInputs:
    """Inputs for slices whose pages are already reserved. ``positions`` overrides RoPE
    positions (default: cache positions). ``pad_to`` pads a one-token-per-slice batch to a
    CUDA-graph batch size with scratch rows."""
    ps = cache.page_size
    page_lists: list[tuple[int, ...]] = []
    kv_lens: list[int] = []
    slots: list[int] = []
    q_lens: list[int] = []
    for s in slices:
        end = s.start + s.num_tokens
        pages = tuple(cache.seq(s.request_id, s.label).pages[: pages_for(end, ps)])
        page_lists.append(pages)
        kv_lens.append(end)
        q_lens.append(s.num_tokens)
        slots.extend(cache.slots(s.request_id, s.label, s.start, s.num_tokens))
    if positions is None:
        positions = torch.tensor([p for s in slices for p in range(s.start, s.start + s.num_tokens)], dtype=torch.long)
    num_rows = len(slots)
    if positions.shape != (num_rows,):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected ({num_rows},)")
    pad = 0
    if pad_to is not None:
        if any(n != 1 for n in q_lens) or pad_to < len(slices):
            raise ValueError(f"pad_to={pad_to} needs at most that many one-token slices")
        pad = pad_to - len(slices)
    tables = page_lists + [(SCRATCH_PAGE,)] * pad
    table = build_csr(tables, kv_lens + [1] * pad, ps)
    q_lens += [1] * pad
    qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    attn = AttentionBatch(
        qo_indptr, table, torch.tensor(slots + [SCRATCH_PAGE * ps] * pad, dtype=torch.long), causal
    )
    positions = torch.cat([positions.long().cpu(), torch.zeros(pad, dtype=torch.long)])
    return StepInputs(tuple(slices), positions, attn, tuple(page_lists), num_rows)
