"""The LLM side of BAGEL over the KV-cache engine: context blocks into labelled caches, greedy
decoding, flow velocities, and moving a request's contexts between engines.

Every request holds up to three labelled caches (``requests.LABELS``) and, per label, the next RoPE
position (text advances it by its length, an image block by one). All passes are the engine's
direct ``forward(items)``: one item per (request, label), several requests in one pass. Blocks
append their K/V; a flow step's query block ([soi, latents, eoi] at the context's position) attends
to its context and to itself, and drops its K/V.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass

import torch

from mstar.models.bagel.config import BagelConfig
from mstar.models.bagel.flow import FlowParams, LatentAdapter
from mstar.models.bagel.llm import BagelLLM
from mstar.models.bagel.requests import LABELS
from mstar.services.engines.kv_engine import EngineConfig, ForwardItem, KVCacheEngine


@dataclass
class RequestContexts:
    ropes: dict[str, int]
    mark: tuple[int, int] | None = None  # (main's length, its rope) before a think decode


class BagelLM:
    """One engine (one set of LLM weights) and the contexts of the requests it holds. Shared by
    the ``llm`` node and the CFG branch nodes placed in the same group. Passes run inside
    ``session()``; ``release_soon`` may come from another thread (the node group's event loop)
    and is applied at once when no pass runs, else when the running one ends."""

    def __init__(self, cfg: BagelConfig, llm: BagelLLM, adapter: LatentAdapter, engine_config: EngineConfig,
                 sequence_parallel=None):
        """``sequence_parallel``: a ``TensorParallel`` group of ranks, each with all the weights
        (``BagelLLM.shard_over``). Rank 0 is driven by the node; it sends every call that
        changes the caches or makes a pass to the other ranks (``follow``), which make it too:
        the caches stay alike, and each pass's non-causal rows are split over the ranks."""
        self.cfg, self.llm, self.adapter = cfg, llm, adapter
        self.group = sequence_parallel
        #: a rank past 0: it makes rank 0's passes for their caches and K/V; their results are rank 0's
        self.follower = self.group is not None and not self.group.leader
        if self.group is not None:
            llm.shard_over(self.group)
        self.engine = KVCacheEngine(llm, engine_config, page_group=self.group)
        self.device = self.engine.device
        self.dtype = self.engine.dtype
        self.contexts: dict[str, RequestContexts] = {}
        self.lock = threading.Lock()
        self._pending: deque[str] = deque()
        t = cfg.tokens
        self._markers = torch.tensor([t.soi, t.eoi], device=self.device)

    def _mirror(self, name: str, *args) -> None:
        """Rank 0 of a sequence-parallel group: the other ranks make this call too."""
        if self.group is not None and self.group.leader:
            self.group.send_call(name, args)

    def follow(self) -> None:
        """Ranks past 0: make rank 0's calls until its ``close``."""
        self.group.follow_calls(self)

    def close(self) -> None:
        """Release ranks 1.. (after any pass in flight: the stop must not cut into its calls)."""
        if self.group is not None:
            with self.lock:
                self.group.stop_followers()

    def _ctx(self, rid: str) -> RequestContexts:
        return self.contexts.setdefault(rid, RequestContexts({label: 0 for label in LABELS}))

    def _pass(self, items: list[ForwardItem], gen_rows: torch.Tensor | None, causal: bool) -> list[torch.Tensor]:
        with self.llm.routed(gen_rows):
            return self.engine.forward(items, causal=causal)

    def _image_block(self, middle: torch.Tensor) -> torch.Tensor:
        soi, eoi = self.llm.embed(self._markers).to(middle.dtype)
        return torch.cat([soi[None], middle, eoi[None]])

    # -- context blocks ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_text(self, blocks: list[tuple[str, tuple[str, ...], torch.Tensor]]) -> None:
        """(request, labels, ids) -> each id block appended to each of its labels, causally."""
        self._mirror("prefill_text", blocks)
        items = []
        for rid, labels, ids in blocks:
            ctx, n = self._ctx(rid), len(ids)
            for label in labels:
                items.append(ForwardItem(rid, label, token_ids=ids, positions=ctx.ropes[label] + torch.arange(n)))
        self._pass(items, None, causal=True)
        for rid, labels, ids in blocks:
            for label in labels:
                self._ctx(rid).ropes[label] += len(ids)

    @torch.inference_mode()
    def prefill_image(self, blocks: list[tuple[str, tuple[str, ...], torch.Tensor]], generation: bool) -> list[torch.Tensor]:
        """(request, labels, middle embeddings) -> [soi, middle, eoi] appended non-causally at one
        position; ``generation``: the middle rows are VAE latents (the generation expert). Returns
        the final hidden states of each (request, label) item."""
        self._mirror("prefill_image", blocks, generation)
        items, rows = [], []
        for rid, labels, middle in blocks:
            ctx, seq = self._ctx(rid), self._image_block(middle.to(self.device, self.dtype))
            for label in labels:
                items.append(ForwardItem(rid, label, embeds=seq, positions=torch.full((len(seq),), ctx.ropes[label])))
                rows.append(_middle_rows(len(seq)))
        hidden = self._pass(items, torch.cat(rows) if generation else None, causal=False)
        for rid, labels, _ in blocks:
            for label in labels:
                self._ctx(rid).ropes[label] += 1
        return hidden

    def vae_tokens(self, latent_tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """A clean image's latent tokens [h·w, 64] -> their LLM inputs (flow time 0)."""
        return self.adapter.embed(latent_tokens.to(self.device), torch.zeros(1), h, w)

    # -- decoding ----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, steps: list[tuple[str, int, bool]]) -> list[int]:
        """(request, token, first) -> the greedy next token of each; ``first`` marks a decode's
        first step (its token is <|im_start|> at the context's position), remembered for ``rewind``."""
        self._mirror("decode", steps)
        items = []
        for rid, token, first in steps:
            ctx = self._ctx(rid)
            if first:
                ctx.mark = (self.engine.cache.length(rid, "main"), ctx.ropes["main"])
            items.append(ForwardItem(rid, "main", token_ids=torch.tensor([token]),
                                     positions=torch.tensor([ctx.ropes["main"]])))
        hidden = self._pass(items, None, causal=True)
        for rid, _, _ in steps:
            self._ctx(rid).ropes["main"] += 1
        if self.follower:  # no logits: a vocabulary-wide GEMM and a host sync a token, for nothing
            return []
        return self.llm.compute_logits(torch.cat(hidden)).argmax(dim=-1).tolist()

    def rewind(self, rid: str) -> None:
        """Drop what the request's last decode appended to main (think mode re-adds its text)."""
        self._mirror("rewind", rid)
        ctx = self._ctx(rid)
        if ctx.mark is not None:
            length, rope = ctx.mark
            self.engine.cache.truncate(rid, "main", length)
            ctx.ropes["main"], ctx.mark = rope, None

    # -- flow ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def velocities(self, steps: list[tuple[str, torch.Tensor, float, FlowParams, tuple[str, ...]]]) -> list[dict[str, torch.Tensor]]:
        """(request, x_t [h·w, 64], t, params, labels) -> each label's velocity [h·w, 64]: one
        non-causal pass over every (request, label), nothing appended."""
        self._mirror("velocities", steps)
        items, rows = [], []
        for rid, x, t, p, labels in steps:
            h, w = p.latent_hw(self.cfg.latent_downsample)
            seq = self._image_block(self.adapter.embed(x.to(self.device), torch.tensor([t], dtype=torch.float32), h, w))
            for label in labels:
                items.append(ForwardItem(rid, label, embeds=seq, append=False,
                                         positions=torch.full((len(seq),), self._ctx(rid).ropes[label])))
                rows.append(_middle_rows(len(seq)))
        hidden = iter(self._pass(items, torch.cat(rows), causal=False))
        if self.follower:
            return []
        return [{label: self.adapter.llm2vae(next(hidden)[1:-1]).float() for label in labels}
                for _, _, _, _, labels in steps]

    # -- moving contexts ------------------------------------------------------------------------
    def export(self, rid: str, labels: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's K/V of ``labels`` concatenated along tokens, and [label index, length,
        rope] per label (int64 [k, 3])."""
        ctx = self._ctx(rid)
        kvs, meta = [], []
        for label in labels:
            kv = (self.engine.export_kv(rid, label) if self.engine.cache.has_seq(rid, label)
                  else torch.empty(0))
            n = kv.shape[2] if kv.numel() else 0
            if n:
                kvs.append(kv)
            meta.append([LABELS.index(label), n, ctx.ropes[label]])
        kv = torch.cat(kvs, dim=2) if kvs else torch.empty(0)
        return kv, torch.tensor(meta, dtype=torch.long).reshape(-1, 3)

    def import_(self, rid: str, kv: torch.Tensor, meta: torch.Tensor) -> None:
        """Take contexts ``export`` produced elsewhere (the same weights)."""
        self._mirror("import_", rid, kv, meta)
        ctx, start = self._ctx(rid), 0
        for index, n, rope in meta.tolist():
            label = LABELS[index]
            self.engine.cache.free_seq(rid, label)
            if n:
                self.engine.cache.scatter(rid, label, kv[:, :, start:start + n])
            start += n
            ctx.ropes[label] = rope

    @contextlib.contextmanager
    def session(self):
        with self.lock:
            self._drain()
            try:
                yield self
            finally:
                self._drain()

    def release_soon(self, rid: str) -> None:
        self._pending.append(rid)
        if self.lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self.lock.release()

    def _drain(self) -> None:
        while self._pending:
            self.release(self._pending.popleft())

    def has(self, rid: str, label: str) -> bool:
        return self.engine.cache.has_seq(rid, label)

    def release(self, rid: str) -> None:
        self._mirror("release", rid)
        self.engine.release(rid)
        self.contexts.pop(rid, None)


def _middle_rows(n: int) -> torch.Tensor:
    rows = torch.ones(n, dtype=torch.bool)
    rows[0] = rows[-1] = False
    return rows
