"""The blocks of Qwen3-Omni's decoders: RMSNorm, rotary tables (1-D and interleaved M-RoPE),
attention with per-head q/k norms over a cache context (cache.py), SwiGLU, and the two MoE
blocks (the Thinker's top-k router; the Talker's, plus a sigmoid-gated shared expert).

Tokens are flat ``[N, hidden]``; the cache context knows which sequence each row belongs to.
Parameter names follow the checkpoint (``q_proj``, ``mlp.gate``...), experts stacked per layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.qwen3_omni.config import DecoderConfig
from mstar.services.engines.compiled import compiled, owned

#: without torch._grouped_mm, a step with at most this many (token, expert) pairs gathers each
#: pair's expert weights (one batched matmul); larger ones loop over the experts hit
GATHER_MAX_PAIRS = 64
#: MoE paths: "grouped_mm" (tokens sorted by expert, one grouped GEMM for gate/up and one for down:
#: no Python loop, no host sync, CUDA-graph friendly; on CUDA a decode-sized batch runs the two as
#: the Triton kernels of services/engines/moe_triton.py), "gather", "loop" (the naive per-expert path)
MOE_PATHS = ("auto", "grouped_mm", "gather", "loop")

#: the decode-sized experts' Triton kernels, where CUDA and Triton are (imported here so that a
#: torch.compile'd caller sees a module global; not on a CPU, where the tests import them under
#: Triton's interpreter); without them the grouped GEMMs run every batch
MOE_KERNELS: Any = None
if torch.cuda.is_available():
    try:
        from mstar.services.engines import moe_triton as MOE_KERNELS
    except ImportError as e:
        logging.getLogger(__name__).warning("MoE decode kernels unavailable (%s): grouped GEMMs for every batch", e)


def grouped_mm_ok(*dims: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> bool:
    """torch._grouped_mm exists for this device and dtype (CUDA: bfloat16 on sm_90+) and these
    inner dimensions meet its 16-byte stride rule."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dev = torch.device(device)
    if dev.type == "cuda" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(dev) < (9, 0)):
        return False
    size = torch.empty((), dtype=dtype).element_size()
    return all((d * size) % 16 == 0 for d in dims)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight, self.eps)


def inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))


def rope_1d(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] -> cos, sin [N, dim] (fp32)."""
    f = positions.float()[:, None] * freqs.to(positions.device)[None, :]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def rope_mrope(positions: torch.Tensor, freqs: torch.Tensor, section: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved M-RoPE: positions [3, N] (temporal, height, width) -> cos, sin [N, dim].
    Frequency i rotates by the temporal position, except every third one from 1 (height,
    ``section[1]`` of them) and from 2 (width, ``section[2]``)."""
    f = positions.float()[..., None] * freqs.to(positions.device)  # [3, N, dim/2]
    out = f[0].clone()
    for axis in (1, 2):
        idx = slice(axis, section[axis] * 3, 3)
        out[..., idx] = f[axis][..., idx]
    emb = torch.cat([out, out], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, dim]; cos/sin [N, dim]."""
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * c + rotate_half(x) * s


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, qk_norm: bool = True,
                 bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx, layer: int) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(ctx.attend(layer, q, k, v).reshape(n, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))


class Experts(nn.Module):
    """All experts of one layer: ``gate_up`` [E, 2I, H] (gate rows first), ``down`` [E, H, I]."""

    def __init__(self, experts: int, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.zeros(experts, 2 * inner, hidden))
        self.down = nn.Parameter(torch.zeros(experts, hidden, inner))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, path: str = "auto") -> torch.Tensor:
        """x [T, H], index/weight [T, k] -> sum_k weight * expert_k(x). An index equal to the
        number of experts here is another rank's expert (tensor parallelism): that pair adds 0."""
        t, k = index.shape
        if path == "auto":
            path = "grouped_mm" if grouped_mm_ok(*self.down.shape[1:], dtype=x.dtype, device=x.device) else \
                "gather" if t * k <= GATHER_MAX_PAIRS else "loop"
        if path == "grouped_mm":
            return self._grouped_mm(x, index, weight)
        if path == "gather":
            n = self.gate_up.shape[0]
            flat = index.reshape(-1).clamp(max=n - 1)
            xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [T*k, H, 1]
            gate, up = torch.bmm(self.gate_up[flat], xs)[..., 0].chunk(2, dim=-1)
            y = torch.bmm(self.down[flat], (F.silu(gate) * up)[:, :, None])[..., 0]
            weight = torch.where(index < n, weight, 0)
            return (y.view(t, k, -1) * weight[..., None].to(y.dtype)).sum(1)
        return self._loop(x, index, weight)

    def _grouped_mm(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x, index, weight, self.gate_up, self.down)

    def _loop(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert; one matmul pair per expert that has any (the naive path: the
        parity reference for a fused kernel, and the prefill path on a CPU)."""
        t, k = index.shape
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0] + 1).tolist()[:-1]  # last: other ranks'
        token = order // k
        xs = x[token]
        out = torch.zeros((t * k, x.shape[1]), dtype=x.dtype, device=x.device)
        at = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            seg = xs[at : at + c]
            gate, up = F.linear(seg, self.gate_up[e]).chunk(2, dim=-1)
            out[at : at + c] = F.linear(F.silu(gate) * up, self.down[e])
            at += c
        scaled = out * weight.reshape(-1)[order, None].to(out.dtype)
        y = torch.zeros_like(x)
        return y.index_add_(0, token, scaled)


class GroupedGemms:
    """The two projections of ``grouped_experts`` as torch._grouped_mm, one group per expert: the
    default path, and the surface (``moe_gate_up``, ``moe_down``) that the Triton decode kernels
    (``services/engines/moe_triton.py``) share."""

    @staticmethod
    def moe_gate_up(x: torch.Tensor, token: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """h [P, I] = silu(gate) * up of each sorted pair's row (``token``) through its expert."""
        gate, up = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def moe_down(h: torch.Tensor, ends: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(h.contiguous(), down.transpose(1, 2), offs=ends)


def grouped_experts(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, kernels: Any = "auto") -> torch.Tensor:
    """``Experts`` by two grouped projections: (token, expert) pairs sorted by expert, one group
    each. ``kernels``: what runs them, ``GroupedGemms`` or the Triton decode kernels' module
    (``moe_triton``); "auto": the kernels on CUDA for a batch they take (``fits``), else the GEMMs."""
    t, k = index.shape
    if isinstance(kernels, str):
        fit = MOE_KERNELS is not None and MOE_KERNELS.fits(x, t * k, gate_up)
        kernels = MOE_KERNELS if fit else GroupedGemms
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    n = gate_up.shape[0]
    # one bin past the experts: other ranks' pairs sort last, past every group's rows
    counts = torch.zeros(n + 1, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts[:n], 0).to(torch.int32)  # (no bincount: it reads the max back on CUDA)
    token = order // k
    y = kernels.moe_down(kernels.moe_gate_up(x, token, offs, gate_up), offs, down)
    mine = (flat[order] < n)[:, None]  # rows past the last offset are not computed: never read them
    scaled = torch.where(mine, y * weight.reshape(-1)[order, None].to(y.dtype), 0)
    return torch.zeros_like(x).index_add_(0, token, scaled)


def route_topk(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> each token's top-k experts [T, k] and their weights [T, k] (x's dtype)."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, index = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return index, top.to(logits.dtype)


class SparseMoe(nn.Module):
    """Top-k routed experts; with ``shared`` (the Talker) plus a sigmoid-gated shared expert."""

    def __init__(self, cfg: DecoderConfig, shared: bool):
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared else None
        self.path = "auto"  # one of MOE_PATHS (tests pin one)

    #: the first of the experts this module holds (an expert-parallel rank holds a range)
    first = 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> each token's top-k experts [T, k] and their weights [T, k] (x's dtype)."""
        return route_topk(x, self.gate.weight, self.top_k, self.norm_topk)

    def fused(self, x: torch.Tensor, backend: Any) -> torch.Tensor:
        """``forward`` as one torch.compile'd function (``DecoderLayer.compiled``): the routing, the
        grouped experts and the shared expert fused around their GEMMs."""
        e, se = self.experts, self.shared_expert
        shared = () if se is None else (se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight,
                                        self.shared_expert_gate.weight)  # type: ignore[union-attr]
        return compiled(moe_share, backend)(x, self.gate.weight, e.gate_up, e.down, self.top_k, self.norm_topk,
                                            self.first, *shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, *self.route(x), self.path)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # type: ignore[misc]
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int, moe: str):
        """``moe``: "thinker" (routed experts where the config says, SwiGLU elsewhere), "talker"
        (routed + shared expert in every layer) or "none" (the code predictor)."""
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module
        if moe == "talker":
            self.mlp = SparseMoe(cfg, shared=True)
        elif moe == "thinker" and cfg.is_moe_layer(index):
            self.mlp = SparseMoe(cfg, shared=False)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.index = index
        self.compiled: Any = None  # torch.compile's backend for ``_fused`` (``compile_layers``); None: eager

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        if self.compiled is not None and (not isinstance(self.mlp, SparseMoe) or self.mlp.path == "auto"):
            return self._fused(x, cos, sin, ctx)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, self.index)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """``forward`` with the work between the GEMM-heavy parts in torch.compile'd functions: the
        norm, projections, q/k norms and RoPE before the attention; the residual and norm after
        o_proj; the MoE (``SparseMoe.fused``). The attention over the cache and any all-reduce
        (tensor parallelism: o_proj's, the experts') stay outside, eager."""
        a, n1, n2 = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        x = owned(x)
        q, k, v = compiled(_attn_in, self.compiled)(x, cos, sin, n1.weight, n1.eps, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                                 a.q_norm.weight if a.q_norm is not None else None,
                                 a.k_norm.weight if a.k_norm is not None else None, a.heads, a.kv_heads, a.head_dim)
        x, h = compiled(_add_norm, self.compiled)(x, a.o_proj(ctx.attend(self.index, q, k, v).reshape(x.shape[0], -1)), n2.weight, n2.eps)
        mlp = self.mlp.fused(h, self.compiled) if isinstance(self.mlp, SparseMoe) else self.mlp(h)
        return x + mlp


class Decoder(nn.Module):
    """Layers + final norm over input embeddings. ``capture`` (k >= 1): also return the output
    of layer k-1 (transformers' ``hidden_states[k]``, taken before any DeepStack add)."""

    def __init__(self, cfg: DecoderConfig, moe: str, embedding: nn.Module | None = None, embedding_name: str = ""):
        super().__init__()
        self.cfg = cfg
        if embedding is not None:  # named as in the checkpoint (embed_tokens, codec_embedding)
            setattr(self, embedding_name, embedding)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, moe) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx, capture: int | None = None,
                deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        captured = None
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx)
            if capture is not None and i == capture - 1:
                captured = x
            if deepstack is not None and i < len(deepstack[1]):
                rows, feats = deepstack
                x = x.index_add(0, rows, feats[i].to(x.dtype))
        return self.norm(x), captured


# -- a decoder layer's pieces under torch.compile (``DecoderLayer._fused``; services/engines/compiled.py) --

def _attn_in(x, cos, sin, norm_w, eps: float, q_w, k_w, v_w, q_norm, k_norm, heads: int, kv_heads: int, head_dim: int):
    n = x.shape[0]
    h = _rms(x, norm_w, eps)
    q, k = F.linear(h, q_w).view(n, heads, head_dim), F.linear(h, k_w).view(n, kv_heads, head_dim)
    if q_norm is not None:
        q, k = _rms(q, q_norm, eps), _rms(k, k_norm, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), F.linear(h, v_w).view(n, kv_heads, head_dim)


def _add_norm(x, delta, norm_w, eps: float):
    x = x + delta
    return x, _rms(x, norm_w, eps)


def local_experts(index: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Global expert indices -> indices into the ``n`` experts from ``first`` held here; ``n`` (no
    expert: weight 0) for another rank's."""
    local = index - first
    return torch.where((local >= 0) & (local < n), local, n)


def moe_share(x, router, gate_up, down, top_k: int, norm_topk: bool, first: int, *shared):
    """``SparseMoe.forward`` over experts ``[first, first + len(gate_up))``: all of them, or an
    expert-parallel rank's share (another rank's expert weighs 0 here)."""
    index, weight = route_topk(x, router, top_k, norm_topk)
    y = grouped_experts(x, local_experts(index, first, gate_up.shape[0]), weight, gate_up, down)
    if shared:
        gate_w, up_w, down_w, shared_gate = shared
        y = y + torch.sigmoid(F.linear(x, shared_gate)) * F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)
    return y


def compile_layers(decoder: nn.Module, backend: Any = "inductor") -> None:
    """Run ``decoder``'s layers as ``DecoderLayer._fused`` says, under torch.compile with ``backend``
    (None: eagerly again). Its MoE is the grouped-GEMM path: refused where torch._grouped_mm is not.

    A node group steps its engines on threads of their own and torch.compile is not thread-safe
    (services/engines/compiled.py; a served run failed so: bench/results/qwen3_omni/README.md,
    2026-11-26f), so a node compiles every piece before its engine steps: ``warm_compiled``."""
    for m in decoder.modules() if backend is not None else ():
        if isinstance(m, Experts) and not grouped_mm_ok(*m.down.shape[1:], dtype=m.down.dtype, device=m.down.device):
            raise ValueError(f"compiled decoder layers need torch._grouped_mm for {m.down.dtype} experts on {m.down.device}")
    for m in decoder.modules():
        if isinstance(m, DecoderLayer):
            m.compiled = backend


def warm_compiled(forward: Callable[[torch.Tensor, torch.Tensor], Any], hidden: int, dtype: torch.dtype,
                  device: torch.device | str) -> None:
    """Compile every piece of the layers under ``compile_layers`` now, before any engine steps
    (``compile_layers`` says why): ``forward(embeds [N, hidden], positions [3, N])`` is a pass of
    the decoder over ``NoCache``, at one row and more (dynamo may specialise a size of 1), under
    inference mode and under no_grad (the engines run both: two entries of each piece). On
    tensor-parallel ranks every rank warms at once (the pieces' all-reduces pair up). Where the
    MoE decode kernels are, a pass of more rows than they take as well: the compiled MoE piece
    holds a branch on the batch's size (``MOE_KERNELS.fits``), and each side compiles once."""
    sizes = (1, 2, 3) + ((MOE_KERNELS.MAX_PAIRS + 1,) if MOE_KERNELS is not None else ())
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            for n in sizes:
                forward(torch.zeros(n, hidden, dtype=dtype, device=device), torch.zeros(3, n, device=device))
