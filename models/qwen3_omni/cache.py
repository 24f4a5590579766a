"""A slot KV cache for the Thinker's and the Talker's own engines.

Each running sequence owns one slot: per layer, K and V of ``[max_len, kv_heads, head_dim]`` rows.
A pass attends either whole prompts of several sequences (a prefill, each causal within itself) or
one new token of each of several sequences (a decode, each over its own prefix). A layer's cache
is ``[slots + 1, max_len, kv_heads, head_dim]``: the paged layout with one page of ``max_len`` rows
a slot, so a decode on a GPU attends each row's keys where they lie (the engines' Triton decode
kernel, ``attn_triton.py``) instead of gathering them.
This is the shape the repo's paged ``KVCacheEngine`` does not yet take for these models (M-RoPE
positions, prompt embeddings, MoE layers, captured hidden states): see docs/models/qwen3_omni.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar.services.engines.batch import h2d

#: ``SlotCache``'s decode attention paths
ATTENTION = ("auto", "torch", "triton")


class SlotCache:
    """``num_slots`` slots to hand out, and one more, ``scratch``, that is never handed out: a
    CUDA graph's padded rows write their K/V there (``decode_graphs.py``)."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, kv_heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype, attention: str = "auto"):
        """``attention``: how a decode attends, "torch" (gathers each row's keys; the CPU's, and
        the reference), "triton" (in place, the Triton decode kernel), or "auto" (Triton on CUDA
        in bf16 / fp16 with a power-of-two head_dim of at least 16, else torch)."""
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: one of {ATTENTION}")
        shape = (num_slots + 1, max_len, kv_heads, head_dim)
        self.attention = attention
        if attention == "auto":
            fits = (torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
                    and head_dim >= 16 and head_dim & (head_dim - 1) == 0)
            self.attention = "triton" if fits else "torch"
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_len, self.num_slots, self.scratch = max_len, num_slots, num_slots
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


class PrefillBatch:
    """Whole prompts of several sequences in one pass: tokens flat, sequence after sequence
    (``lengths``), each written at the start of its slot and attending causally within itself
    (padded to the longest for one attention call per layer)."""

    def __init__(self, cache: SlotCache, slots: list[int], lengths: list[int], device):
        if max(lengths) > cache.max_len:
            raise ValueError(f"sequence of {max(lengths)} tokens is longer than the cache's max_len={cache.max_len}")
        self.cache, self.b, self.longest = cache, len(lengths), max(lengths)
        seq = torch.repeat_interleave(torch.arange(self.b), torch.tensor(lengths))
        pos = torch.cat([torch.arange(n) for n in lengths])
        self.seq, self.pos = h2d(seq, device), h2d(pos, device)  # uploads that wait for no queued work
        self.slot = h2d(torch.tensor(slots), device)[self.seq]
        keys = torch.arange(self.longest, device=device)
        valid = keys[None, :] < h2d(torch.tensor(lengths), device)[:, None]  # [B, L]
        self.mask = (keys[None, :, None] >= keys[None, None, :]) & valid[:, None, :]  # [B, Lq, Lk]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, heads, d], k/v [N, kv, d] -> [N, heads, d]."""
        self.cache.k[layer][self.slot, self.pos] = k
        self.cache.v[layer][self.slot, self.pos] = v
        if self.b == 1:
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                                 is_causal=True, enable_gqa=True)
            return out[0].transpose(0, 1)
        pad = [t.new_zeros(self.b, self.longest, *t.shape[1:]).index_put_((self.seq, self.pos), t) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in pad), attn_mask=self.mask[:, None],
                                             enable_gqa=True)
        return out.transpose(1, 2)[self.seq, self.pos]


@dataclass
class Decode:
    """One new token per sequence; ``lengths[b]`` tokens of ``slots[b]`` precede it. Each row
    attends the first ``span`` keys of its slot, those past its own length masked: any span of at
    least max(lengths) + 1 gives the same result (a CUDA graph's is its span bucket's)."""

    cache: SlotCache
    slots: torch.Tensor  # [B] int64 on the cache's device
    lengths: torch.Tensor  # [B] int64 on the cache's device
    span: int  # keys attended, >= max(lengths) + 1, at most the cache's max_len: a host int

    def __post_init__(self) -> None:
        self.kernel = None  # the Triton path's, made at its first layer (its heads are q's)
        if self.cache.attention == "torch":
            # keys past each row's own token, once for every layer: [B, 1, 1, span]
            keys = torch.arange(self.span, device=self.lengths.device)
            self.blocked = (keys[None, :] > self.lengths[:, None])[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, heads, d], k/v [B, kv, d] -> [B, heads, d]."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self.slots, self.lengths] = k
        vc[self.slots, self.lengths] = v
        if self.cache.attention == "triton":
            return self._in_place(q, kc, vc)
        # [B, kv, span, d]
        keys, values = kc[self.slots, : self.span].transpose(1, 2), vc[self.slots, : self.span].transpose(1, 2)
        # each KV head's group of query heads in one matmul: K/V are read once, never repeated per
        # query head (SDPA with a mask and GQA takes its math path, which does repeat them)
        b, heads, d = q.shape
        kv = keys.shape[1]
        scores = torch.matmul(q.view(b, kv, heads // kv, d), keys.transpose(-1, -2)).float() * d ** -0.5
        scores = scores.masked_fill(self.blocked, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [B, kv, group, d]
        return out.reshape(b, heads, d)

    def _in_place(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """Each slot as one page of ``max_len`` rows: the kernel reads a row's keys where they lie."""
        if self.kernel is None:  # once a pass: its table and split buffers serve every layer
            from mstar.services.engines.attention import HeadShape
            from mstar.services.engines.attn_triton import DeviceTableDecode
            heads = HeadShape(q.shape[1], kc.shape[2], kc.shape[3])
            self.kernel = DeviceTableDecode(heads, self.cache.max_len, self.slots, self.lengths + 1, self.span)
        q = q if q.stride()[1:] == (q.shape[2], 1) else q.contiguous()
        return self.kernel.run(q, kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]))


@dataclass
class NoCache:
    """A whole sequence at once, causal (tests, the code predictor's short sequences)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)

