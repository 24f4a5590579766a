"""Paged attention behind one interface: per-step metadata, a backend protocol, and the
pure-torch reference backend (used on CPU, and as the yardstick for FlashInfer).

Every backend sees the new tokens' K/V already written into the cache (the layer writes
them at ``AttentionBatch.slots`` before calling ``run``). Query ``j`` of a sequence with
``q_len`` new tokens and ``kv_len`` cached tokens (new ones included) sits at position
``kv_len - q_len + j``; causal attention lets it see keys up to that position, non-causal
attention lets it see all ``kv_len`` keys (a denoising block, a world-model frame).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from mstar.services.engines.pages import CsrPageTable, build_csr

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionBatch:
    """What every layer of one forward pass shares (host tensors; backends move what they need)."""

    qo_indptr: torch.Tensor  # int32 [batch + 1]
    table: CsrPageTable  # kv after the new tokens are written
    slots: torch.Tensor  # int64 [num_q_tokens]: cache slot (page * page_size + offset) of each new token
    causal: bool = True

    @property
    def q_lens(self) -> tuple[int, ...]:
        ptr = self.qo_indptr.tolist()
        return tuple(b - a for a, b in zip(ptr[:-1], ptr[1:], strict=True))

    @property
    def batch_size(self) -> int:
        return self.table.batch_size

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def is_decode(self) -> bool:
        """One query per sequence: the decode kernels apply (causality is moot)."""
        return self.num_tokens == self.batch_size

    def query_rows(self, lo: int, hi: int) -> AttentionBatch:
        """The same attention for query rows [lo, hi) of the pass only (a sequence-parallel rank's
        share): each sequence keeps its keys; sequences with no row there drop out. Non-causal
        only (a causal query's position comes from its place among its sequence's new rows)."""
        if self.causal:
            raise ValueError("query_rows splits non-causal passes only")
        ptr = self.qo_indptr.tolist()
        if not 0 <= lo < hi <= ptr[-1]:
            raise ValueError(f"query rows [{lo}, {hi}) outside the pass's {ptr[-1]}")
        t = self.table
        keep = [b for b in range(len(ptr) - 1) if ptr[b] < hi and ptr[b + 1] > lo]
        q_lens = [min(ptr[b + 1], hi) - max(ptr[b], lo) for b in keep]
        qo = torch.zeros(len(keep) + 1, dtype=torch.int32)
        qo[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
        indptr = t.kv_indptr.tolist()
        pages = [t.kv_indices[indptr[b]:indptr[b + 1]].tolist() for b in keep]
        table = build_csr(pages, [t.kv_lens[b] for b in keep], t.page_size)
        return AttentionBatch(qo, table, self.slots[lo:hi], causal=False)


@dataclass(frozen=True)
class HeadShape:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads={self.num_qo_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


class AttentionBackend(Protocol):
    name: str

    def plan(self, batch: AttentionBatch) -> None:
        """Once per forward pass, before any layer runs."""

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [num_q_tokens, Hq, D]; caches [num_pages, page_size, Hkv, D] -> [num_q_tokens, Hq, D]."""
        ...


class TorchPagedAttention:
    """Reference backend: gathers each sequence's pages into a padded batch and calls SDPA."""

    name = "torch"

    def __init__(self, heads: HeadShape, device: torch.device | str = "cpu"):
        self.heads = heads
        self.device = torch.device(device)
        self._plan: _TorchPlan | None = None

    def plan(self, batch: AttentionBatch) -> None:
        self._plan = _TorchPlan.build(batch, self.device)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        p = self._plan
        if p is None:
            raise RuntimeError("TorchPagedAttention.run before plan")
        h = self.heads
        k = k_cache.reshape(-1, h.num_kv_heads, h.head_dim)[p.kv_slots]  # [B, maxKV, Hkv, D]
        v = v_cache.reshape(-1, h.num_kv_heads, h.head_dim)[p.kv_slots]
        k = k.repeat_interleave(h.group, dim=2).transpose(1, 2)  # [B, Hq, maxKV, D]
        v = v.repeat_interleave(h.group, dim=2).transpose(1, 2)
        qp = q.new_zeros(p.batch, p.max_q, h.num_qo_heads, h.head_dim)
        qp[p.q_row, p.q_col] = q
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), k, v, attn_mask=p.mask, scale=1.0 / math.sqrt(h.head_dim)
        )
        return out.transpose(1, 2)[p.q_row, p.q_col]


@dataclass(frozen=True)
class _TorchPlan:
    batch: int
    max_q: int
    kv_slots: torch.Tensor  # int64 [B, maxKV]
    mask: torch.Tensor  # bool [B, 1, maxQ, maxKV]
    q_row: torch.Tensor  # int64 [num_q_tokens]: sequence of each query token
    q_col: torch.Tensor  # int64 [num_q_tokens]: its index within the sequence

    @classmethod
    def build(cls, batch: AttentionBatch, device: torch.device) -> _TorchPlan:
        t = batch.table
        q_lens, kv_lens, ps = batch.q_lens, t.kv_lens, t.page_size
        n_b, max_q, max_kv = len(q_lens), max(q_lens), max(max(kv_lens), 1)
        indptr, indices = t.kv_indptr.tolist(), t.kv_indices.tolist()
        kv_slots = torch.zeros(n_b, max_kv, dtype=torch.long)
        mask = torch.zeros(n_b, 1, max_q, max_kv, dtype=torch.bool)
        mask[:, :, :, 0] = True  # padded query rows see one key, so SDPA returns no NaN
        keys = torch.arange(max_kv)
        for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            pages = torch.tensor(indices[indptr[b] : indptr[b + 1]], dtype=torch.long)
            tok = torch.arange(kv_len)
            kv_slots[b, :kv_len] = pages[tok // ps] * ps + tok % ps
            pos = kv_len - q_len + torch.arange(q_len)  # absolute position of each query
            limit = pos[:, None] if batch.causal else torch.full((q_len, 1), kv_len - 1)
            mask[b, 0, :q_len] = keys[None, :] <= limit
        q_row = torch.repeat_interleave(torch.arange(n_b), torch.tensor(q_lens))
        q_col = torch.cat([torch.arange(n) for n in q_lens])
        return cls(
            n_b, max_q, kv_slots.to(device), mask.to(device), q_row.to(device), q_col.to(device)
        )


def make_backend(kind: str, heads: HeadShape, device: torch.device, dtype: torch.dtype, page_size: int,
                 prefill: str = "fa2"):
    """'torch', 'flashinfer', or 'auto' (FlashInfer on CUDA when importable, else torch);
    ``prefill``: FlashInfer's kernels for multi-token passes (``EngineConfig.prefill_attention``)."""
    if kind not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"Unknown attention backend '{kind}'. Known: auto, torch, flashinfer")
    if kind == "torch" or (kind == "auto" and device.type != "cuda"):
        return TorchPagedAttention(heads, device)
    from mstar.services.engines.attn_flashinfer import FlashInferAttention, flashinfer_available

    if kind == "auto" and not flashinfer_available():
        log.warning("attention on %s: torch (SDPA over gathered pages), not FlashInfer: the flashinfer package is not "
                    "installed (`make setup` on a GPU host installs it; or pip install 'mstar[gpu]')", device)
        return TorchPagedAttention(heads, device)
    log.info("attention on %s: FlashInfer (paged prefill and decode)", device)
    return FlashInferAttention(heads, device, dtype, page_size, prefill_backend=prefill)
