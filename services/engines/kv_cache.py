"""Paged KV storage with several labelled sequences per request.

A request may own one sequence per label ("main", "cfg_text", "cfg_img", ...). A sequence
has a committed ``length`` (tokens whose K/V persist) and a page list that may hold more
capacity than that. A forward pass writes new K/V after ``length``; ``commit`` keeps them,
``truncate`` drops them (attend-without-append, failed steps). ``gather`` / ``scatter`` move a
sequence's committed K/V out of and into the pages as one per-token tensor (a hand-off between
engines whose page sizes need not match).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from mstar.services.engines.pages import PageAllocator, pages_for

log = logging.getLogger(__name__)

#: Pages kept out of circulation: padded rows of a CUDA-graph batch read and write page 0.
NUM_SCRATCH_PAGES = 1


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def pages_for_bytes(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_page


def kv_budget_bytes(device: torch.device, kv_cache_bytes: int | None, gpu_memory_fraction: float) -> int:
    """An explicit byte budget, or (CUDA only) a fraction of the device's free memory."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if device.type != "cuda":
        raise ValueError(f"kv_cache_bytes is required on device '{device}' (free memory is only read on CUDA)")
    if not 0.0 < gpu_memory_fraction <= 1.0:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction}")
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * gpu_memory_fraction)


@dataclass
class SeqPages:
    """One labelled sequence's page list and committed length (host side)."""

    pages: list[int] = field(default_factory=list)
    length: int = 0


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_pages: int, device: torch.device | str = "cpu"):
        if num_pages <= NUM_SCRATCH_PAGES:
            raise ValueError(
                f"KV cache of {num_pages} pages is too small: {spec.bytes_per_page} bytes per page; "
                "raise kv_cache_bytes"
            )
        self.spec = spec
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages, NUM_SCRATCH_PAGES)
        # [layer, k|v, page, slot, kv_head, dim]: FlashInfer's NHD layout per layer and per k/v.
        shape = (spec.num_layers, 2, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        self.kv = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        self._seqs: dict[str, dict[str, SeqPages]] = {}

    @classmethod
    def from_budget(
        cls,
        spec: KVCacheSpec,
        device: torch.device | str,
        kv_cache_bytes: int | None = None,
        gpu_memory_fraction: float = 0.9,
        tp=None,
    ) -> PagedKVCache:
        """``tp``: a ``TensorParallel`` rank; every rank gets the fewest pages any rank can
        hold (the leader's page ids index every rank's cache)."""
        device = torch.device(device)
        budget = kv_budget_bytes(device, kv_cache_bytes, gpu_memory_fraction)
        num_pages = spec.pages_for_bytes(budget)
        if tp is not None and tp.size > 1:
            num_pages = tp.min_int(num_pages)
        log.info("KV cache: %d pages x %d tokens, %d bytes/token", num_pages, spec.page_size, spec.bytes_per_token)
        return cls(spec, num_pages, device)

    # -- storage -------------------------------------------------------------------------
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of layer i, each [num_pages, page_size, num_kv_heads, head_dim]."""
        return self.kv[i, 0], self.kv[i, 1]

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    # -- sequences -----------------------------------------------------------------------
    def seq(self, request_id: str, label: str = "main") -> SeqPages:
        """The sequence, created empty on first use."""
        return self._seqs.setdefault(request_id, {}).setdefault(label, SeqPages())

    def has_seq(self, request_id: str, label: str = "main") -> bool:
        return label in self._seqs.get(request_id, {})

    def labels(self, request_id: str) -> list[str]:
        return list(self._seqs.get(request_id, {}))

    def request_ids(self) -> list[str]:
        return list(self._seqs)

    def length(self, request_id: str, label: str = "main") -> int:
        seq = self._seqs.get(request_id, {}).get(label)
        return seq.length if seq else 0

    def pages_needed(self, request_id: str, label: str, num_tokens: int) -> int:
        """Further pages the sequence needs to hold ``num_tokens`` tokens in all."""
        seq = self._seqs.get(request_id, {}).get(label)
        have = len(seq.pages) if seq else 0
        return max(0, pages_for(num_tokens, self.page_size) - have)

    def reserve(self, request_id: str, label: str, num_tokens: int) -> None:
        """Grow the sequence's page list to hold ``num_tokens`` tokens (raises OutOfPages)."""
        need = self.pages_needed(request_id, label, num_tokens)
        if need:
            new = self.allocator.alloc(need)
            self.seq(request_id, label).pages.extend(new)

    def slots(self, request_id: str, label: str, start: int, n: int) -> list[int]:
        """Flat slot ids (page * page_size + offset) of token positions [start, start + n)."""
        pages, ps = self.seq(request_id, label).pages, self.page_size
        return [pages[t // ps] * ps + t % ps for t in range(start, start + n)]

    def commit(self, request_id: str, label: str, length: int) -> None:
        seq = self.seq(request_id, label)
        if length > len(seq.pages) * self.page_size:
            raise ValueError(f"{request_id}/{label}: commit of {length} tokens beyond its pages")
        seq.length = length

    def truncate(self, request_id: str, label: str, length: int | None = None) -> None:
        """Drop tokens after ``length`` (default: the committed length) and free pages past it."""
        seq = self._seqs.get(request_id, {}).get(label)
        if seq is None:
            return
        seq.length = min(seq.length, seq.length if length is None else length)
        keep = pages_for(seq.length, self.page_size)
        self.allocator.free(seq.pages[keep:])
        del seq.pages[keep:]

    def free_seq(self, request_id: str, label: str = "main") -> None:
        labels = self._seqs.get(request_id)
        if labels is None or label not in labels:
            return
        self.allocator.free(labels.pop(label).pages)
        if not labels:
            del self._seqs[request_id]

    def release(self, request_id: str) -> int:
        """Free every labelled sequence of the request; returns the number of pages freed."""
        labels = self._seqs.pop(request_id, {})
        freed = 0
        for seq in labels.values():
            self.allocator.free(seq.pages)
            freed += len(seq.pages)
        return freed

    # -- moving a sequence's K/V between caches --------------------------------------------
    def check_kv(self, kv: torch.Tensor, what: str) -> None:
        """``kv`` must be [num_layers, 2, num_tokens, num_kv_heads, head_dim] of this cache."""
        s = self.spec
        want = (s.num_layers, 2, s.num_kv_heads, s.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
            raise ValueError(
                f"{what}: K/V of shape {tuple(kv.shape)}; this cache takes [num_layers, 2, num_tokens, "
                f"num_kv_heads, head_dim] = ({s.num_layers}, 2, num_tokens, {s.num_kv_heads}, {s.head_dim})"
            )

    def gather(self, request_id: str, label: str = "main") -> torch.Tensor:
        """A contiguous copy of the sequence's committed K/V, [num_layers, 2, length,
        num_kv_heads, head_dim] in the cache's dtype and device: one index_select, no pages
        freed. KeyError when the request holds no such sequence."""
        seq = self._seqs.get(request_id, {}).get(label)
        if seq is None:
            raise KeyError(f"request {request_id!r} holds no {label!r} sequence in this KV cache "
                           f"(its labels here: {self.labels(request_id)})")
        return self._flat().index_select(2, self._slot_ids(seq.pages, seq.length)).view(self.spec.dtype)

    def scatter(self, request_id: str, label: str, kv: torch.Tensor) -> None:
        """Create the sequence holding ``kv`` [num_layers, 2, n, num_kv_heads, head_dim] (any
        device or dtype; converted first) as its committed K/V: pages taken, one index_copy_,
        length n. OutOfPages leaves nothing allocated; an existing sequence is a ValueError."""
        what = f"request {request_id!r} / {label!r}"
        if self.has_seq(request_id, label):
            raise ValueError(f"{what} already holds a sequence in this KV cache; release it first")
        self.check_kv(kv, what)
        kv = kv.to(self.device, self.spec.dtype).contiguous()  # before any page is taken: a failed copy leaves nothing
        n = kv.shape[2]
        pages = self.allocator.alloc(pages_for(n, self.page_size))  # OutOfPages: nothing taken
        try:
            flat = self._flat()
            flat.index_copy_(2, self._slot_ids(pages, n), kv.view(flat.dtype))
        except BaseException:
            self.allocator.free(pages)
            raise
        self._seqs.setdefault(request_id, {})[label] = SeqPages(pages, n)

    def _flat(self) -> torch.Tensor:
        """The storage as [num_layers, 2, slot, num_kv_heads, words] (a view), in 8-byte words
        where a head's row divides into them: index_select / index_copy_ move one element per
        thread, so 16k tokens of a Llama-3.2-3B's bf16 K/V were gathered at 0.57 TB/s as bf16
        and 1.58 TB/s as int64; a plain copy moves 2.1 TB/s (H200, kv_handoff_bench.py,
        bench/results/engines/2026-11-26-kv-handoff/)."""
        s = self.spec
        flat = self.kv.view(s.num_layers, 2, -1, s.num_kv_heads, s.head_dim)
        return flat.view(torch.int64) if s.head_dim * flat.element_size() % 8 == 0 else flat

    def _slot_ids(self, pages: list[int], n: int) -> torch.Tensor:
        """Flat slot ids of positions [0, n) on the cache's device, without a per-token loop."""
        ps = self.page_size
        ids = (torch.tensor(pages[: pages_for(n, ps)], dtype=torch.long)[:, None] * ps + torch.arange(ps)).flatten()[:n]
        if self.device.type == "cuda":  # pinned, so the copy does not wait for queued device work (batch.h2d)
            return ids.pin_memory().to(self.device, non_blocking=True)
        return ids.to(self.device)
