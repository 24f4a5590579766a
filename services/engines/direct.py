"""Direct passes over labelled caches: the loop shapes that are not token-by-token decoding
(denoising blocks that attend without appending, CFG branches, world-model frames)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar.services.engines.batch import SeqSlice, build_step_inputs
from mstar.services.engines.kv_cache import PagedKVCache
from mstar.services.engines.model_runner import ModelRunner


@dataclass(frozen=True)
class ForwardItem:
    """New tokens for one labelled cache of a request, in a direct ``forward`` pass."""

    request_id: str
    label: str = "main"
    token_ids: torch.Tensor | None = None  # [n]
    embeds: torch.Tensor | None = None  # [n, hidden], instead of token_ids
    append: bool = True  # False: attend to the cache and to each other, then drop their K/V
    positions: torch.Tensor | None = None  # RoPE positions [n]; default: cache length + arange(n)

    @property
    def num_tokens(self) -> int:
        t = self.token_ids if self.token_ids is not None else self.embeds
        if t is None or (self.token_ids is not None and self.embeds is not None):
            raise ValueError(f"{self.request_id}/{self.label}: give exactly one of token_ids and embeds")
        return t.shape[0]


@torch.inference_mode()
def run_direct(runner: ModelRunner, cache: PagedKVCache, items: Sequence[ForwardItem],
               causal: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """One pass; returns final hidden states per item. Whatever the pass reserved is given
    back if it raises; committed K/V are never touched."""
    keys = [(it.request_id, it.label) for it in items]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a (request, label) cache appears twice in one pass: {keys}")
    slices: list[SeqSlice] = []
    try:
        for it in items:
            start, n = cache.length(it.request_id, it.label), it.num_tokens
            cache.reserve(it.request_id, it.label, start + n)
            slices.append(SeqSlice(it.request_id, it.label, start, n))
        positions = torch.cat([
            it.positions.long().cpu() if it.positions is not None else torch.arange(s.start, s.start + s.num_tokens)
            for it, s in zip(items, slices, strict=True)
        ])
        inputs = build_step_inputs(cache, slices, causal, positions)
        embeds = torch.cat([
            it.embeds.to(cache.device, dtype) if it.embeds is not None
            else runner.model.embed(it.token_ids.to(cache.device))  # type: ignore[union-attr]
            for it in items
        ])
        hidden = runner.run(inputs, embeds=embeds)
    except BaseException:
        for s in slices:
            cache.truncate(s.request_id, s.label)
        raise
    for it, s in zip(items, slices, strict=True):
        if it.append:
            cache.commit(s.request_id, s.label, s.start + s.num_tokens)
        else:
            cache.truncate(s.request_id, s.label)
    return list(hidden.split([s.num_tokens for s in slices]))
