"""Decoder building blocks shared by every model that runs on the paged KV cache:
RMSNorm, rotary embeddings (incl. Llama-3 frequency scaling), SwiGLU MLP, paged GQA
attention, and a pre-norm decoder layer.

Projections that read the same input are fused at load time into one GEMM: q/k/v into
``self_attn.qkv_proj``, gate/up into ``mlp.gate_up_proj``. Each fused module lists the
Hugging Face Llama modules it stacks and their row counts (``checkpoint_rows``), so HF
checkpoints load by name: ``self_attn.q_proj.weight`` fills the first rows of
``self_attn.qkv_proj.weight`` (see ``weights.py``).

On CUDA the projection weights are stored column-major (``set_weight_layout``): same values
and shapes, but F.linear hands cuBLAS a row-major [K, N] operand, which its kernels stream faster
at decode batch sizes.

The elementwise work between the GEMMs goes through ``ForwardContext.ops`` (``kernels.py``):
pure torch by default (the reference), fused CUDA kernels when the engine picks them. Module
``forward`` methods called without a context are the torch reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mstar.services.engines.attention import AttentionBackend, AttentionBatch, HeadShape
from mstar.services.engines.kernels import TORCH_OPS, Ops, rms_norm_ref, rope_ref


@dataclass(frozen=True)
class ForwardContext:
    """What attention layers need for one forward pass over the paged cache."""

    backend: AttentionBackend
    kv: torch.Tensor  # [layer, k|v, page, slot, kv_head, dim] (PagedKVCache.kv)
    slots: torch.Tensor  # int64 [num_tokens]: cache slot of each new token's K/V
    ops: Ops = field(default=TORCH_OPS)  # RMSNorm / RoPE / SiLU·mul / K/V store kernels
    # decode steps without norm kernels (DecoderLayer.forward_fused_norms): the layers' RMSNorm
    # weights are folded into their projections and the fused decode backend applies row scales
    fused_norms: bool = False
    # with fused_norms: the down projection and its residual add as one Triton kernel
    # (gemm_triton.linear_add_; the down weights stored row-major) instead of cuBLAS addmm
    triton_down: bool = False
    # with fused_norms: the Triton GEMMs and the SiLU·mul kernel launch as programmatic dependents
    # (pdl.py; the graphs set the attention backend's own switch)
    pdl: bool = False
    # with fused_norms: qkv and o_proj (+ residual add) as Triton kernels (gemm_triton.linear /
    # linear_add_; their weights stored row-major) instead of cuBLAS
    triton_proj: bool = False
    # the pass's whole attention batch (the backend planned the model's ``attention_share`` of it
    # when the model has one); None in captured decode graphs
    attn: AttentionBatch | None = None


class FusedProjections:
    """Groups of ``nn.Linear`` of one input (q / k / v; gate / up), each group computed as one GEMM.
    ``fuse()`` concatenates a group's weights (and biases) into one tensor and re-points each
    Linear's parameters to views of it, so the weights are held once and ``state_dict`` /
    checkpoint names are unchanged. Call it last, after loading and any ``.to()`` (a later cast or
    move would copy the views apart)."""

    #: group name -> the Linears' attribute names, in output order
    fused_groups: dict[str, tuple[str, ...]] = {}

    def fuse(self) -> None:
        self._fused = {}
        for group, names in self.fused_groups.items():
            linears = [getattr(self, n) for n in names]
            weight = torch.cat([lin.weight.detach() for lin in linears])
            bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
            row = 0
            for lin in linears:
                rows = lin.weight.shape[0]
                lin.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
                if bias is not None:
                    lin.bias = nn.Parameter(bias[row:row + rows], requires_grad=False)
                row += rows
            self._fused[group] = (weight, bias)

    def fused_weight(self, group: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of ``group`` (the first group when None), concatenated."""
        fused = getattr(self, "_fused", None)
        if fused is None:
            raise RuntimeError(f"{type(self).__name__}: call fuse() once its weights are loaded")
        return fused[group] if group is not None else next(iter(fused.values()))

    def fused(self, x: torch.Tensor, group: str | None = None) -> torch.Tensor:
        """The concatenated outputs of ``group`` (the first group when None), in its order."""
        return F.linear(x, *self.fused_weight(group))


def fuse_projections(module: nn.Module) -> nn.Module:
    """``fuse()`` every ``FusedProjections`` block of ``module``; returns ``module``."""
    for m in module.modules():
        if isinstance(m, FusedProjections):
            m.fuse()
    return module


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 ("llama3") frequency scaling; ``factor`` 1 with no bands means none."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    s = scaling
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                 max_positions: int = 131072):
        super().__init__()
        self._params = (head_dim, theta, scaling)
        self.max_positions = max_positions
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._cos_sin: torch.Tensor | None = None

    def _apply(self, fn, recurse=True):
        # Keep inv_freq fp32 and initialised whatever .to(dtype) / .to_empty() did to it.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(*self._params).to(self.inv_freq.device)
        self._cos_sin = None
        return self

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """fp32 [max_positions, head_dim]: cos | sin of position * inv_freq, the same angles
        as ``forward`` (for fused RoPE kernels; built on first use, outside graph capture)."""
        if self._cos_sin is None or self._cos_sin.device != device:
            pos = torch.arange(self.max_positions, device=device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
            self._cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
        return self._cos_sin

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q [n, Hq, D], k [n, Hkv, D], positions [n] -> rotated (q, k)."""
        return rope_ref(self.inv_freq, q, k, positions)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one GEMM."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, tp=None):
        """``intermediate``: this rank's rows when ``tp`` (a ``TensorParallel``) splits the MLP."""
        super().__init__()
        self.intermediate = intermediate
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def checkpoint_rows(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Fused child -> the checkpoint modules stacked along its output rows, in order."""
        return {"gate_up_proj": (("gate_proj", self.intermediate), ("up_proj", self.intermediate))}

    def tp_split(self) -> dict[str, int]:
        """Parameter -> the dim its checkpoint tensors split along over tensor-parallel ranks
        (biases of row-parallel layers load on rank 0 only: see ``load_checkpoint``)."""
        return {"gate_up_proj.weight": 0, "gate_up_proj.bias": 0, "down_proj.weight": 1}

    def forward(self, x: torch.Tensor, ops: Ops = TORCH_OPS) -> torch.Tensor:
        out = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


class PagedAttention(nn.Module):
    """GQA self-attention whose K/V live in the paged cache.

    New tokens' K/V are written at ``ctx.slots``, then the backend attends every query to its
    sequence's cached prefix plus the new tokens.
    """

    def __init__(self, layer_idx: int, hidden: int, heads: HeadShape, rope: RotaryEmbedding,
                 qkv_bias: bool = False, o_bias: bool = False, tp=None):
        """``heads``: this rank's heads when ``tp`` (a ``TensorParallel``) splits them."""
        super().__init__()
        self.layer_idx, self.heads, self.rope = layer_idx, heads, rope
        self.tp = tp if tp is not None and tp.size > 1 else None
        d = heads.head_dim
        self.q_size, self.kv_size = heads.num_qo_heads * d, heads.num_kv_heads * d
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)

    def checkpoint_rows(self) -> dict[str, tuple[tuple[str, int], ...]]:
        return {"qkv_proj": (("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size))}

    def tp_split(self) -> dict[str, int]:
        return {"qkv_proj.weight": 0, "qkv_proj.bias": 0, "o_proj.weight": 1}

    def qkv(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Un-rotated q [n, Hq, D], k, v [n, Hkv, D]: views into one GEMM's output (a Triton one
        where ``ctx.triton_proj``)."""
        n, h = x.shape[0], self.heads
        if ctx is not None and ctx.triton_proj:
            from mstar.services.engines.gemm_triton import linear

            out = linear(x, self.qkv_proj.weight, pdl=ctx.pdl, trigger=ctx.pdl)
        else:
            out = self.qkv_proj(x)
        q, k, v = out.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(n, h.num_qo_heads, h.head_dim), k.view(n, h.num_kv_heads, h.head_dim),
                v.view(n, h.num_kv_heads, h.head_dim))

    def attend(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
               row_rms: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """Attention output [n, q_size] before o_proj. ``row_rms`` (x, eps): ``x`` is not normalised;
        the fused RoPE + store backend scales q / k / v by each row's 1 / rms (that backend only)."""
        q, k, v = self.qkv(x, ctx)
        kv_layer = ctx.kv[self.layer_idx]
        if getattr(ctx.backend, "fuses_rope_store", False):  # one kernel: RoPE, K/V store, attention
            o = ctx.backend.run_rope_store(q, k, v, positions, ctx.slots, kv_layer, self.rope.cos_sin_cache(q.device),
                                           row_rms=row_rms)
        else:
            if row_rms is not None:
                raise ValueError(f"attention backend '{ctx.backend.name}' does not apply row scales")
            q, k = ctx.ops.rope(self.rope, q, k, positions)
            ctx.ops.store_kv(kv_layer, ctx.slots, k, v)
            o = ctx.backend.run(q, kv_layer[0], kv_layer[1])
        return o.reshape(x.shape[0], self.q_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        out = self.o_proj(self.attend(x, positions, ctx))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    Carries the residual stream separately so each residual add fuses into the next norm:
    ``forward`` takes the previous layer's (output, residual) and returns its own; the model
    applies the last add with its final norm.
    """

    def __init__(self, self_attn: PagedAttention, mlp: GatedMLP, hidden: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ops, n1, n2 = ctx.ops, self.input_layernorm, self.post_attention_layernorm
        if residual is None:  # first layer: x is the embeddings, which in-place kernels must not touch
            residual = x.clone() if ops.in_place else x
            h = ops.rms_norm(x, n1.weight, n1.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, n1.weight, n1.eps)
        h = self.self_attn(h, positions, ctx)
        h, residual = ops.add_rms_norm(h, residual, n2.weight, n2.eps)
        return self.mlp(h, ops), residual

    def forward_fused_norms(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> None:
        """The layer without its two RMSNorm kernels, on the residual stream ``h`` [n, hidden],
        updated in place (``ctx.fused_norms``; needs ``fused_norms_unavailable_reason`` None).

        The norm weights live in the projections (``fold_norms``), so norm(h) @ W.T = r · (h @ W.T)
        with r = 1 / rms(h) per row: the qkv and gate_up GEMMs read ``h`` itself, the fused decode
        kernel and the SiLU·mul kernel compute r and scale, and o_proj / down add into ``h`` in
        their GEMM (beta = 1), which replaces the residual adds."""
        from mstar.services.engines.gemm_triton import linear_add_
        from mstar.services.engines.rowscale_triton import silu_mul_rowscale

        a, mlp = self.self_attn, self.mlp
        o = a.attend(h, positions, ctx, row_rms=(h, self.input_layernorm.eps))
        if ctx.triton_proj:
            linear_add_(h, o, a.o_proj.weight, pdl=ctx.pdl, trigger=ctx.pdl)
        else:
            h.addmm_(o, a.o_proj.weight.t())
        act = silu_mul_rowscale(mlp.gate_up_proj(h), h, self.post_attention_layernorm.eps, pdl=ctx.pdl)
        if ctx.triton_down:
            linear_add_(h, act, mlp.down_proj.weight, pdl=ctx.pdl, trigger=ctx.pdl and ctx.triton_proj)
        else:
            h.addmm_(act, mlp.down_proj.weight.t())


def fold_norm_weights(layer: DecoderLayer) -> None:
    """Multiply the layer's input / post-attention RMSNorm weights into the columns of the
    projections that read their outputs (qkv, gate_up) and set them to ones:
    (x̂ · g) @ W.T = x̂ @ (W · g).T. The same function (in bf16 the product rounds once more);
    storage layout kept."""
    for norm, lin in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                      (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
        w = lin.weight
        w.data.copy_((w.float() * norm.weight.float()[None, :]).to(w.dtype))
        norm.weight.data.fill_(1)


def fused_norms_unavailable_reason(layer: DecoderLayer, folded: bool) -> str | None:
    """Why ``forward_fused_norms`` cannot run this layer (None: it can)."""
    a, mlp = layer.self_attn, layer.mlp
    if not folded:
        return "the RMSNorm weights are not folded into the projections (fold_norms)"
    if a.tp is not None or mlp.tp is not None:
        return "tensor parallel: o_proj / down all-reduce before the residual add"
    if any(lin.bias is not None for lin in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)):
        return "projection biases (the row scale and the residual add would apply to them)"
    return None


def set_weight_layout(module: nn.Module, column_major: bool, only: str | None = None) -> None:
    """Store every attention and MLP projection weight ([N, K]) column-major (its transpose [K, N]
    contiguous) or row-major. Values and shapes are unchanged, so are checkpoints and results.
    On an H100, cuBLAS reads the [K, N] form faster at decode sizes (gate_up 38.4 -> 36.4 µs at
    batch 1, o_proj 12.3 -> 9.7 µs at batch 16; down 3% slower at 64), and qkv / o_proj ~10%
    slower at 2048-token prefill (bench/results/engines/README.md, GEMM efficiency).
    ``only``: just the projections of that name (e.g. ``down_proj``, which the Triton down
    projection ``gemm_triton.linear_add_`` streams row-major)."""
    for m in module.modules():
        if isinstance(m, PagedAttention | GatedMLP):
            for name, lin in m.named_children():
                if isinstance(lin, nn.Linear) and only in (None, name):
                    w = lin.weight
                    if (w.stride() == (1, w.shape[0])) != column_major:
                        w.data = w.data.t().contiguous().t() if column_major else w.data.contiguous()
