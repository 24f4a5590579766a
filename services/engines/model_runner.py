"""Runs a decoder over the paged cache for one set of step inputs: plan attention once,
embed, run the layers (or replay a captured CUDA graph for a padded decode batch)."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from mstar.services.engines.attention import AttentionBackend, HeadShape
from mstar.services.engines.batch import StepInputs, h2d
from mstar.services.engines.kernels import TORCH_OPS, Ops
from mstar.services.engines.kv_cache import PagedKVCache
from mstar.services.engines.layers import ForwardContext

log = logging.getLogger(__name__)


class PagedDecoderConfig(Protocol):
    num_layers: int
    hidden_size: int
    vocab_size: int

    @property
    def heads(self) -> HeadShape: ...


class PagedDecoder(Protocol):
    """What a model offers the KV-cache engine (``LlamaForCausalLM`` is one)."""

    config: PagedDecoderConfig

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, vocab_ranges: tuple[tuple[int, int], ...] = ()) -> torch.Tensor: ...


class ModelRunner:
    def __init__(self, model: PagedDecoder, cache: PagedKVCache, backend: AttentionBackend, graphs=None,
                 ops: Ops = TORCH_OPS, tp=None):
        """``tp``: a ``TensorParallel`` rank; the leader's runs are mirrored on every follower
        (``follow``)."""
        self.model, self.cache, self.backend, self.graphs, self.ops = model, cache, backend, graphs, ops
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.device = cache.device
        # fused RoPE reads a cos/sin table of this many rows: positions past it must not reach it
        self.max_position = (getattr(model.config, "max_position_embeddings", None)
                             if ops.position_table else None)
        self.last_run_replayed = False  # whether the latest run() replayed a CUDA graph
        # a model that runs part of the pass's queries (BAGEL's sequence-parallel ranks) plans only those
        self.attention_share = getattr(model, "attention_share", None)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, token_ids: torch.Tensor | None = None,
            embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [num_rows, hidden] of the step's token rows (padding dropped).

        Give ``token_ids`` [num_rows] or ``embeds`` [num_rows, hidden] (multimodal inputs)."""
        if (token_ids is None) == (embeds is None):
            raise ValueError("give exactly one of token_ids and embeds")
        if self.max_position is not None and inputs.positions.numel():
            top = int(inputs.positions.max())  # a host tensor: no device sync
            if top >= self.max_position:
                raise ValueError(f"position {top} is past max_position_embeddings={self.max_position}")
        if token_ids is not None and token_ids.device.type == "cpu":
            token_ids = h2d(token_ids, self.device)
        if self.tp is not None:  # followers run the same pass on their shards
            x = (token_ids if token_ids is not None else embeds.to(self.device)).contiguous()
            self.tp.send(("run", inputs, token_ids is not None, tuple(x.shape), x.dtype))
            self.tp.broadcast(x)
            token_ids, embeds = (x, None) if token_ids is not None else (None, x)
        return self._run(inputs, token_ids, embeds)

    def follow(self) -> None:
        """A follower rank: run what the leader runs until it sends ``stop``."""
        if self.tp is None:
            raise RuntimeError("follow() is for tensor-parallel ranks past 0")

        def run(command) -> None:
            _, inputs, are_ids, shape, dtype = command
            x = self.tp.broadcast(torch.empty(shape, dtype=dtype, device=self.device))
            self._run(inputs, x if are_ids else None, None if are_ids else x)

        self.tp.follow(run)

    def stop_followers(self) -> None:
        if self.tp is not None:
            self.tp.stop_followers()

    def _run(self, inputs: StepInputs, token_ids: torch.Tensor | None, embeds: torch.Tensor | None) -> torch.Tensor:
        graph_ok = self.graphs is not None and token_ids is not None and inputs.attn.is_decode
        self.last_run_replayed = graph_ok and inputs.padded_rows in self.graphs.batch_sizes
        if self.last_run_replayed:
            return self.graphs.replay(inputs, token_ids)
        if embeds is None:
            embeds = self.model.embed(token_ids)
        n = inputs.num_rows
        if inputs.padded_rows != n:
            raise ValueError("padded step inputs without a captured graph")
        self.backend.plan(self.attention_share(inputs.attn) if self.attention_share is not None else inputs.attn)
        ctx = ForwardContext(self.backend, self.cache.kv, h2d(inputs.attn.slots, self.device), self.ops,
                             attn=inputs.attn)
        return self.model(embeds.to(self.device), h2d(inputs.positions, self.device), ctx)
