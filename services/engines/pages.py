"""Fixed-size KV pages: a free-page allocator and FlashInfer's CSR page-table layout."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


class OutOfPages(RuntimeError):
    """The KV cache has fewer free pages than a sequence needs."""

    def __init__(self, wanted: int, free: int, total: int):
        super().__init__(
            f"KV cache out of pages: wanted {wanted}, {free} free of {total}; "
            "raise kv_cache_bytes (or gpu_memory_fraction) or lower max_num_seqs"
        )
        self.wanted = wanted
        self.free = free
        self.total = total


class PageAllocator:
    """Hands out page ids from a free list.

    Pages ``[0, num_reserved)`` are never handed out: the engine uses them as scratch
    (padding rows of a CUDA-graph batch write there), so ``num_free`` counts only the rest.
    """

    def __init__(self, num_pages: int, num_reserved: int = 0):
        if num_pages <= num_reserved:
            raise ValueError(f"num_pages={num_pages} must exceed num_reserved={num_reserved}")
        self.num_pages = num_pages
        self.num_reserved = num_reserved
        # Popped from the end: low ids first, which keeps small caches easy to read in tests.
        self._free = list(range(num_pages - 1, num_reserved - 1, -1))
        self._in_use = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - self.num_reserved

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free), self.num_usable)
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._in_use[p] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not self.num_reserved <= p < self.num_pages or not self._in_use[p]:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._in_use[p] = 0
            self._free.append(p)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class CsrPageTable:
    """FlashInfer's page-table layout for a batch of sequences (all int32, on one device).

    Sequence ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; its last page holds
    ``kv_last_page_len[b]`` tokens (1..page_size, 0 only for an empty sequence).
    """

    kv_indptr: torch.Tensor  # [batch + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [batch]
    kv_lens: tuple[int, ...]  # tokens per sequence, kept on the host for planning
    page_size: int

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    def to(self, device: torch.device | str) -> CsrPageTable:
        return CsrPageTable(
            self.kv_indptr.to(device, non_blocking=True),
            self.kv_indices.to(device, non_blocking=True),
            self.kv_last_page_len.to(device, non_blocking=True),
            self.kv_lens,
            self.page_size,
        )


def build_csr(page_lists: Sequence[Sequence[int]], kv_lens: Sequence[int], page_size: int) -> CsrPageTable:
    """CSR page table (host tensors) over the first ``ceil(kv_len / page_size)`` pages of each list."""
    indptr = [0]
    indices: list[int] = []
    last: list[int] = []
    for pages, n in zip(page_lists, kv_lens, strict=True):
        used = pages_for(n, page_size)
        if used > len(pages):
            raise ValueError(f"sequence of {n} tokens needs {used} pages, has {len(pages)}")
        indices.extend(pages[:used])
        indptr.append(len(indices))
        last.append(n - (used - 1) * page_size if used else 0)
    i32 = torch.int32
    return CsrPageTable(
        torch.tensor(indptr, dtype=i32),
        torch.tensor(indices, dtype=i32),
        torch.tensor(last, dtype=i32),
        tuple(int(n) for n in kv_lens),
        page_size,
    )
