"""A slot KV cache for the Thinker's and the Talker's own engines.

Each running sequence owns one slot: per layer, K and V of ``[max_len, kv_heads, head_dim]`` rows.
A step attends either one sequence's new tokens (a prefill, causal over the slot's prefix and
themselves) or one new token of each of several sequences (a decode, each over its own prefix).
This is the shape the repo's paged ``KVCacheEngine`` does not yet take for these models (M-RoPE
positions, prompt embeddings, MoE layers, captured hidden states): see the model's README section.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class SlotCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, kv_heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype):
        shape = (num_slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_len = max_len
        self.free = list(range(num_slots - 1, -1, -1))

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("no free KV slot: every slot holds a running sequence (raise max_num_seqs)")
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self.free)


@dataclass
class Prefill:
    """``n`` new tokens of one sequence, written at ``start`` of ``slot``."""

    cache: SlotCache
    slot: int
    start: int
    n: int

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, heads, d], k/v [n, kv, d] -> [n, heads, d]."""
        end = self.start + self.n
        if end > self.cache.max_len:
            raise ValueError(f"sequence of {end} tokens is longer than the cache's max_len={self.cache.max_len}")
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self.slot, :, self.start:end] = k.transpose(0, 1)
        vc[self.slot, :, self.start:end] = v.transpose(0, 1)
        keys, values = kc[self.slot : self.slot + 1, :, :end], vc[self.slot : self.slot + 1, :, :end]
        qh = q.transpose(0, 1).unsqueeze(0)
        if self.start == 0:
            out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, enable_gqa=True)
        else:
            rows = torch.arange(self.start, end, device=q.device)[:, None]
            mask = torch.arange(end, device=q.device)[None, :] <= rows
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)


@dataclass
class Decode:
    """One new token per sequence; ``lengths[b]`` tokens of ``slots[b]`` precede it."""

    cache: SlotCache
    slots: torch.Tensor  # [B] int64 on the cache's device
    lengths: torch.Tensor  # [B] int64 on the cache's device
    max_len: int  # max(lengths) + 1, a host int

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, heads, d], k/v [B, kv, d] -> [B, heads, d]."""
        if self.max_len > self.cache.max_len:
            raise ValueError(f"sequence of {self.max_len} tokens is longer than the cache's max_len={self.cache.max_len}")
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self.slots, :, self.lengths] = k
        vc[self.slots, :, self.lengths] = v
        keys, values = kc[self.slots, :, : self.max_len], vc[self.slots, :, : self.max_len]
        mask = torch.arange(self.max_len, device=q.device)[None, :] <= self.lengths[:, None]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :],
                                             enable_gqa=True)
        return out[:, :, 0]


@dataclass
class NoCache:
    """A whole sequence at once, causal (tests, the code predictor's short sequences)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)


class Lockstep:
    """``batch`` sequences of equal length growing together by ``n`` tokens a pass (the code
    predictor: one short sequence per frame, every frame of a step at the same position)."""

    def __init__(self, batch: int):
        self.batch = batch
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B*n, heads, d], k/v [B*n, kv, d] (row-major by sequence) -> [B*n, heads, d]."""
        b = self.batch
        n = q.shape[0] // b
        k = k.reshape(b, n, *k.shape[1:]).transpose(1, 2)
        v = v.reshape(b, n, *v.shape[1:]).transpose(1, 2)
        past = self.k.get(layer)
        keys = k if past is None else torch.cat([past, k], dim=2)
        values = v if past is None else torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = keys, values
        qh = q.reshape(b, n, *q.shape[1:]).transpose(1, 2)
        start = keys.shape[2] - n
        if n == 1:
            out = F.scaled_dot_product_attention(qh, keys, values, enable_gqa=True)
        else:
            rows = torch.arange(start, start + n, device=q.device)[:, None]
            mask = torch.arange(keys.shape[2], device=q.device)[None, :] <= rows
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * n, out.shape[1], out.shape[-1])
