"""BAGEL's language model on the paged KV cache: Qwen2.5 with QK-norm, each layer a Mixture of
Transformers. Every layer holds two experts with the same shapes (norms, q/k/v/o, q/k-norm, MLP):
the understanding expert (text, ViT tokens, the vision markers) and the generation expert (VAE
latent tokens). Each token goes through its expert's projections, but attention is one softmax
over every token of the sequence, whichever expert wrote its K/V.

The KV-cache engine calls ``forward(embeds, positions, ctx)`` with no notion of experts, so the
caller names the pass's generation rows first: ``with llm.routed(gen_rows): engine.forward(...)``
(a bool per row of the pass, in item order; None: all understanding). Passes run one at a time
(the node group's forward thread), so one routing slot is enough.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from mstar.models.bagel.config import LLMConfig
from mstar.services.engines.attention import AttentionBatch
from mstar.services.engines.kernels import Ops
from mstar.services.engines.layers import ForwardContext, FusedProjections, RMSNorm, RotaryEmbedding


class Expert(FusedProjections, nn.Module):
    """One expert's half of a layer (q / k / v and gate / up each one GEMM once ``fuse``d)."""

    fused_groups = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=True)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=True)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=True)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.heads = (cfg.num_heads, cfg.num_kv_heads, d)
        self.sizes = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)  # q | k | v widths

    def qkv(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        """Normed q | k | v rows ([n, (Hq + 2 Hkv) * D]) of the layer input, QK-norm per head."""
        hq, hkv, d = self.heads
        n = x.shape[0]
        h = self.fused(norm(ops, self.input_norm, x), "qkv")
        q, k, v = h.split(self.sizes, dim=-1)
        q = norm(ops, self.q_norm, q.reshape(n * hq, d))
        k = norm(ops, self.k_norm, k.reshape(n * hkv, d))
        return torch.cat([q.view(n, -1), k.view(n, -1), v], dim=-1)

    def mlp(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.fused(norm(ops, self.post_norm, x), "gate_up")))


def norm(ops: Ops, rms: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return ops.rms_norm(x, rms.weight, rms.eps)


class Routing:
    """Which rows of a pass go to which expert; ``apply`` runs each row through its own."""

    def __init__(self, gen_rows: torch.Tensor | None, device: torch.device):
        self.und_idx = self.gen_idx = None
        if gen_rows is not None and bool(gen_rows.any()):
            gen_rows = gen_rows.to(device)
            self.gen_idx = gen_rows.nonzero().squeeze(1)
            if not bool(gen_rows.all()):
                self.und_idx = (~gen_rows).nonzero().squeeze(1)
        self.all_gen = self.gen_idx is not None and self.und_idx is None
        # an image block or a flow step: a few marker rows among thousands of latents. The
        # generation expert then takes every row (its marker rows overwritten), which spares
        # gathering and scattering the latents
        self.few_und = self.und_idx is not None and len(self.und_idx) * MINORITY <= len(gen_rows)

    def apply(self, x: torch.Tensor, und: Callable, gen: Callable) -> torch.Tensor:
        if self.gen_idx is None:
            return und(x)
        if self.all_gen:
            return gen(x)
        if self.few_und:
            out = gen(x)
            out[self.und_idx] = und(x[self.und_idx])
            return out
        yu, yg = und(x[self.und_idx]), gen(x[self.gen_idx])
        out = yu.new_empty((x.shape[0], *yu.shape[1:]))
        out[self.und_idx] = yu
        out[self.gen_idx] = yg
        return out


#: a pass whose understanding rows are at most 1 in this many runs every row through the generation expert
MINORITY = 16


class MoTLayer(nn.Module):
    def __init__(self, cfg: LLMConfig, index: int, rope: RotaryEmbedding):
        super().__init__()
        self.und, self.gen = Expert(cfg), Expert(cfg)
        self.index, self.rope = index, rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, route: Routing,
                gather: Callable | None = None) -> torch.Tensor:
        """``gather``: (k, v) of this rank's rows -> (k, v) of every row of the pass (a
        sequence-parallel pass: the rows here are one rank's share; the cache takes all)."""
        n, (hq, hkv, d), ops = x.shape[0], self.und.heads, ctx.ops
        h = route.apply(x, lambda t: self.und.qkv(t, ops), lambda t: self.gen.qkv(t, ops))
        q, k, v = h.split(self.und.sizes, dim=-1)
        q, k = ops.rope(self.rope, q.reshape(n, hq, d), k.reshape(n, hkv, d), positions)
        if getattr(ctx.backend, "fuses_rope_store", False):
            raise ValueError(f"attention backend '{ctx.backend.name}' applies RoPE itself; BAGEL's QK-norm comes first")
        v = v.reshape(n, hkv, d)
        if gather is not None:
            k, v = gather(k, v)
        kv_layer = ctx.kv[self.index]
        ctx.ops.store_kv(kv_layer, ctx.slots, k, v.contiguous())
        o = ctx.backend.run(q, kv_layer[0], kv_layer[1]).reshape(n, hq * d)
        x = x + route.apply(o, self.und.o_proj, self.gen.o_proj)
        return x + route.apply(x, lambda t: self.und.mlp(t, ops), lambda t: self.gen.mlp(t, ops))


class BagelLLM(nn.Module):
    """A ``PagedDecoder`` for the KV-cache engine (embed / forward / compute_logits)."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, None, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(MoTLayer(cfg, i, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_gen = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._gen_rows: torch.Tensor | None = None
        #: a ``TensorParallel`` group whose ranks split each non-causal pass's rows (``shard_over``)
        self.sequence_parallel = None

    @contextlib.contextmanager
    def routed(self, gen_rows: torch.Tensor | None):
        """The next pass's generation rows (bool [rows]); understanding for the rest."""
        self._gen_rows = gen_rows
        try:
            yield
        finally:
            self._gen_rows = None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def shard_over(self, group) -> None:
        """Split the rows of every non-causal pass (image blocks, flow steps) over ``group``'s
        ranks, each holding all the weights and the same cache: rank r runs rows [r·m, (r+1)·m)
        through every layer, the ranks all-gather each layer's K/V (4 KV heads: 17 MB at 1024²),
        and each query attends to all keys as before. The hidden states come back whole on every
        rank. Causal passes (text, decoding) run whole on each rank."""
        self.sequence_parallel = group

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n = embeds.shape[0]
        if self._gen_rows is not None and self._gen_rows.shape[0] != n:
            raise ValueError(f"routing names {self._gen_rows.shape[0]} rows; the pass has {n}")
        split = self._split(ctx.attn)
        if split is not None:
            return self._sharded(embeds, positions, ctx, self.sequence_parallel, *split)
        route = Routing(self._gen_rows, embeds.device)
        h = embeds
        for layer in self.layers:
            h = layer(h, positions, ctx, route)
        return route.apply(h, lambda t: norm(ctx.ops, self.norm, t), lambda t: norm(ctx.ops, self.norm_gen, t))

    def _split(self, attn: AttentionBatch | None) -> tuple[int, int, int] | None:
        """(m, lo, hi): this rank's rows [lo, hi) of a pass split m a rank; None: the pass runs whole
        (no group, a causal pass, a captured graph, or too few rows for every rank to have some)."""
        sp = self.sequence_parallel
        if sp is None or attn is None or attn.causal:
            return None
        n = attn.num_tokens
        m = -(-n // sp.size)
        if (sp.size - 1) * m >= n:
            return None
        return m, sp.rank * m, min(n, (sp.rank + 1) * m)

    def attention_share(self, attn: AttentionBatch) -> AttentionBatch:
        """What the engine plans for a pass (``ModelRunner``): this rank's queries of a split pass."""
        split = self._split(attn)
        return attn if split is None else attn.query_rows(*split[1:])

    def _sharded(self, embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, sp, m: int, lo: int,
                 hi: int) -> torch.Tensor:
        n = embeds.shape[0]
        route = Routing(self._gen_rows[lo:hi] if self._gen_rows is not None else None, embeds.device)

        def whole(x: torch.Tensor, dim: int) -> torch.Tensor:
            """Every rank's rows of x (its rows along ``dim``), in order: all n of them."""
            pad = m - x.shape[dim]
            if pad:
                shape = list(x.shape)
                shape[dim] = pad
                x = torch.cat([x, x.new_zeros(shape)], dim)
            return sp.all_gather(x, dim).narrow(dim, 0, n)

        def gather(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            kv = whole(torch.stack([k, v]), 1)
            return kv[0], kv[1]

        h, pos = embeds[lo:hi], positions[lo:hi]
        for layer in self.layers:
            h = layer(h, pos, ctx, route, gather)
        return whole(route.apply(h, lambda t: norm(ctx.ops, self.norm, t), lambda t: norm(ctx.ops, self.norm_gen, t)), 0)

    def compute_logits(self, hidden: torch.Tensor, vocab_ranges: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        if vocab_ranges:
            raise ValueError("BAGEL computes logits over the whole vocabulary")
        return self.lm_head(hidden)
