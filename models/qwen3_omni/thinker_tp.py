"""The Thinker's language model split over tensor-parallel ranks (``TensorParallel``, the
repo's process groups: gloo on the CPU, NCCL on CUDA).

Per rank ``r`` of ``N``:

* attention: q heads ``[r*h/N, (r+1)*h/N)`` (q/k/v column-parallel), ``o_proj`` row-parallel
  ending in an all-reduce. KV heads are split (``kv/N`` each) when ``N`` divides them; when
  ``kv`` divides ``N`` each rank holds the one KV head its q heads read (replicated over
  ``N/kv`` ranks); other counts are refused.
* routed MoE layers: experts ``[r*E/N, (r+1)*E/N)``. The router is replicated, so every rank
  picks the same top-k; each computes only its experts' (token, expert) pairs, then one
  all-reduce sums the ranks' contributions.
* dense MLP layers: gate/up column-parallel, down row-parallel + all-reduce.
* vocab-parallel embedding (rows ``[r*V', (r+1)*V')``, ``V' = ceil(V/N)``: masked lookup +
  all-reduce, exact) and LM head (each rank its logits slice, all-gathered: every rank gets
  the full logits; the engine's leader samples).

Norms and the router are replicated. ``ThinkerShard.split`` tells the loader which part of
each checkpoint tensor a rank holds, so a rank reads only its shards.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.qwen3_omni.config import DecoderConfig
from mstar.models.qwen3_omni.layers import Experts, SparseMoe, SwiGLU, local_experts
from mstar.models.qwen3_omni.thinker import Thinker


@dataclass(frozen=True)
class ThinkerShard:
    cfg: DecoderConfig  # the whole model's
    rank: int
    size: int

    def __post_init__(self) -> None:
        c, n = self.cfg, self.size
        checks = [("num_attention_heads", c.num_heads, c.num_heads % n == 0),
                  ("num_key_value_heads", c.num_kv_heads, c.num_kv_heads % n == 0 or n % c.num_kv_heads == 0),
                  ("num_experts", c.num_experts, c.num_experts % n == 0),
                  ("intermediate_size", c.intermediate_size, c.intermediate_size % n == 0)]
        for what, value, ok in checks:
            if not ok:
                raise ValueError(f"thinker {what}={value} does not split over tp_size={n}")

    @property
    def q_heads(self) -> int:
        return self.cfg.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return self.cfg.num_kv_heads // self.size if self.cfg.num_kv_heads % self.size == 0 else 1

    @property
    def kv_first(self) -> int:
        if self.cfg.num_kv_heads % self.size == 0:
            return self.rank * self.kv_heads
        return self.rank * self.q_heads // (self.cfg.num_heads // self.cfg.num_kv_heads)

    @property
    def experts(self) -> range:
        per = self.cfg.num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def vocab_rows(self) -> int:
        return math.ceil(self.cfg.vocab_size / self.size)

    def local_cfg(self) -> DecoderConfig:
        return dataclasses.replace(self.cfg, num_heads=self.q_heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=self.cfg.intermediate_size // self.size)

    def split(self, target: str) -> tuple[int, int, int, int] | None:
        """(dim, start, stop, full size) of the checkpoint tensor this rank's ``target`` holds;
        None: the whole tensor (replicated)."""
        c, d = self.cfg, self.cfg.head_dim
        if target in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self.rank * self.vocab_rows, (self.rank + 1) * self.vocab_rows, c.vocab_size
        q = (self.rank * self.q_heads * d, (self.rank + 1) * self.q_heads * d, c.num_heads * d)
        kv = (self.kv_first * d, (self.kv_first + self.kv_heads) * d, c.num_kv_heads * d)
        inner = c.intermediate_size // self.size
        mlp = (self.rank * inner, (self.rank + 1) * inner, c.intermediate_size)
        e = self.experts
        for suffix, cut in ((".self_attn.q_proj.weight", (0, *q)), (".self_attn.k_proj.weight", (0, *kv)),
                            (".self_attn.v_proj.weight", (0, *kv)), (".self_attn.o_proj.weight", (1, *q)),
                            (".mlp.gate_proj.weight", (0, *mlp)), (".mlp.up_proj.weight", (0, *mlp)),
                            (".mlp.down_proj.weight", (1, *mlp)),
                            (".mlp.experts.gate_up", (0, e.start, e.stop, c.num_experts)),
                            (".mlp.experts.down", (0, e.start, e.stop, c.num_experts))):
            if target.endswith(suffix):
                return cut  # type: ignore[return-value]
        return None


class ReducedLinear(nn.Linear):
    """Row-parallel: this rank's input columns, the partial products summed over ranks."""

    def __init__(self, inputs: int, outputs: int, tp):
        super().__init__(inputs, outputs, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, rows: int, hidden: int, first: int, tp):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, hidden))
        self.first, self.tp = first, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.tp.all_reduce(torch.where(mine[..., None], rows, 0))  # one rank's row, others' zeros: exact


class VocabParallelHead(nn.Module):
    def __init__(self, rows: int, hidden: int, vocab: int, tp):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, hidden))
        self.vocab, self.tp = vocab, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(F.linear(hidden, self.weight), dim=-1)[..., : self.vocab]


class ExpertParallelMoe(SparseMoe):
    """The replicated router's top-k; this rank's experts' share of the output, summed over ranks."""

    def __init__(self, cfg: DecoderConfig, experts: range, tp):
        super().__init__(cfg, shared=False)
        self.experts = Experts(len(experts), cfg.hidden_size, cfg.moe_intermediate_size)
        self.first, self.tp = experts.start, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weight = self.route(x)
        local = local_experts(index, self.first, self.experts.gate_up.shape[0])
        return self.tp.all_reduce(self.experts(x, local, weight, self.path))

    def fused(self, x: torch.Tensor, backend: Any) -> torch.Tensor:
        """``forward`` with this rank's share compiled (``SparseMoe.fused``), then the all-reduce."""
        return self.tp.all_reduce(super().fused(x, backend))


def sharded_thinker(shard: ThinkerShard, tp) -> Thinker:
    """This rank's Thinker (build it on the meta device; ``load_module(..., shard=shard)`` fills it)."""
    full, local = shard.cfg, shard.local_cfg()
    thinker = Thinker(local)
    thinker.model.embed_tokens = VocabParallelEmbedding(shard.vocab_rows, full.hidden_size, shard.rank * shard.vocab_rows, tp)
    thinker.lm_head = VocabParallelHead(shard.vocab_rows, full.hidden_size, full.vocab_size, tp)  # type: ignore[assignment]
    for layer in thinker.model.layers:
        layer.self_attn.o_proj = ReducedLinear(local.num_heads * local.head_dim, full.hidden_size, tp)
        if isinstance(layer.mlp, SparseMoe):
            layer.mlp = ExpertParallelMoe(full, shard.experts, tp)
        elif isinstance(layer.mlp, SwiGLU):
            layer.mlp.down_proj = ReducedLinear(local.intermediate_size, full.hidden_size, tp)
    return thinker
