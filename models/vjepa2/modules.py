"""The three networks: the video encoder, the masked predictor and the action-conditioned (AC)
predictor. Parameter names follow the official ``.pt`` layout (fused ``qkv``), so those
checkpoints load as they are (after prefix clean-up); ``weights.py`` maps the Hugging Face one.

All blocks are pre-LayerNorm ViT blocks: fused qkv (with bias) -> 3-D RoPE -> attention -> proj,
and an exact-erf GELU MLP. Tensors between a block's halves are token-major (``[B, N, heads,
head_dim]``, as the qkv GEMM leaves them): SDPA takes them through transposed views.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mstar.models.vjepa2 import rope
from mstar.models.vjepa2.config import ACConfig, EncoderConfig, PredictorConfig
from mstar.services.engines.compiled import compiled, owned

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
#: q, k, v ``[B, N, heads, head_dim]`` (q and k rotated) -> ``[B, N, heads, head_dim]``
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``Attend`` by torch's SDPA (token-major in and out: the heads' transposes are views)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask).transpose(1, 2)


def attention_kernel(spec: str | None) -> Attend:
    """An encoder's attention (no mask: every token sees every token) from the ``attention`` knob:
    None or ``sdpa``: torch's SDPA, its own kernel choice (cuDNN's on Hopper); ``sdpa:cudnn,flash``:
    SDPA trying those kernels in that order. (FlashInfer's fa3 kernels were measured and not kept:
    bench/results/HISTORY.md.)"""
    if spec is None or spec == "sdpa":
        return sdpa
    if spec.startswith("sdpa:"):
        order = spec[5:].split(",")
        if any(n not in SDPA_BACKENDS for n in order):
            raise ValueError(f"attention {spec!r}: SDPA kernels are {', '.join(SDPA_BACKENDS)}")
        backends = [SDPA_BACKENDS[n] for n in order]

        def ordered(q, k, v):  # SDPA trying those kernels in that order (the first that takes the inputs)
            with sdpa_kernel(backends, set_priority=True):
                return sdpa(q, k, v)
        return ordered
    raise ValueError(f"attention must be sdpa or sdpa:<kernels>, got {spec!r}")


class Attention(nn.Module):
    """The block's projections (the official checkpoints' ``attn.qkv`` / ``attn.proj``); the
    attention itself is the network's ``Attend``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)  # Block runs them (_finish)


class Block(nn.Module):
    """A pre-LayerNorm block in two halves around its attention: ``_project`` (norm, qkv, RoPE) and
    ``_finish`` (proj, residual, norm, MLP, residual). Under ``compile_blocks`` the first half is
    LayerNorm, the qkv GEMM and one Triton kernel (``rope_triton``: eagerly the RoPE alone is ~10
    passes over q and k), and the second one torch.compile'd function shared by every block of that
    shape (its elementwise chains fused)."""

    #: torch.compile's backend for the second half (``compile_blocks``); None: both halves eager
    compiled: Any = None

    def __init__(self, dim: int, heads: int, mlp_dim: int, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, mlp_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend = sdpa) -> torch.Tensor:
        project, finish = _project, _finish
        if self.compiled is not None:
            x = owned(x)
            # K/V straight to where the attention keeps them
            project, finish = partial(_project_fused, kv_out=getattr(attend, "kv_out", None)), compiled(_finish, self.compiled)
        n1, n2, a, m = self.norm1, self.norm2, self.attn, self.mlp
        q, k, v = project(x, cos, sin, n1.weight, n1.bias, n1.eps, a.qkv.weight, a.qkv.bias, a.heads)
        return finish(x, attend(q, k, v), a.proj.weight, a.proj.bias, n2.weight, n2.bias, n2.eps,
                      m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias)


# The halves take the block's tensors as arguments (services/engines/compiled.py says why).

def _project(x, cos, sin, norm_w, norm_b, eps: float, qkv_w, qkv_b, heads: int):
    """x ``[B, N, dim]`` -> q, k, v ``[B, N, heads, head_dim]``; ``cos`` / ``sin`` broadcast
    against them (``[N, 1, head_dim]``, or ``[B, N, 1, head_dim]`` for per-row positions)."""
    B, N, C = x.shape
    h = F.layer_norm(x, (C,), norm_w, norm_b, eps)
    q, k, v = F.linear(h, qkv_w, qkv_b).view(B, N, 3, heads, C // heads).unbind(2)
    return rope.apply(q, cos, sin), rope.apply(k, cos, sin), v


def _project_fused(x, cos, sin, norm_w, norm_b, eps: float, qkv_w, qkv_b, heads: int, kv_out=None):
    from mstar.models.vjepa2.rope_triton import qkv_rope

    qkv = F.linear(F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, eps), qkv_w, qkv_b)
    return qkv_rope(qkv, cos, sin, heads, kv_out)


def _finish(x, attended, proj_w, proj_b, norm_w, norm_b, eps: float, fc1_w, fc1_b, fc2_w, fc2_b):
    x = x + F.linear(attended.flatten(2), proj_w, proj_b)
    h = F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, eps)
    return x + F.linear(F.gelu(F.linear(h, fc1_w, fc1_b)), fc2_w, fc2_b)


def compile_blocks(net: nn.Module, backend: Any = "inductor") -> None:
    """Run ``net``'s blocks' halves as ``Block`` says, the second under torch.compile with
    ``backend`` (None: both eager again); the attention between them stays the network's kernel.
    The first half's kernel is Triton's: on a CPU only under ``TRITON_INTERPRET=1`` (the tests)."""
    for m in net.modules():
        if isinstance(m, Block):
            m.compiled = backend


class PatchEmbed(nn.Module):
    """The checkpoints' Conv3d (kernel = stride = tubelet x patch x patch), run as one GEMM over the
    patches: cuDNN's bf16 Conv3d took 1.0 ms of a 28 ms ViT-L clip on an H200 for 26 GFLOP."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        k = (cfg.tubelet, cfg.patch, cfg.patch)
        self.proj = nn.Conv3d(cfg.in_chans, cfg.dim, kernel_size=k, stride=k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, T, H, W]`` -> ``[B, T/t * H/p * W/p, dim]`` (a remainder past whole patches
        dropped, as the convolution drops it)."""
        B, C, T, H, W = x.shape
        t, p, _ = self.proj.kernel_size
        x = x[:, :, :T - T % t, :H - H % p, :W - W % p]
        x = x.reshape(B, C, T // t, t, H // p, p, W // p, p).permute(0, 2, 4, 6, 1, 3, 5, 7)
        patches = x.reshape(B, (T // t) * (H // p) * (W // p), C * t * p * p)
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)


class Encoder(nn.Module):
    """Pixels ``[B, C, T, H, W]`` (normalised) -> ``[B, T/tubelet * H/patch * W/patch, dim]``."""

    #: the attention between the blocks' halves (``attention_kernel``)
    attend: Attend = staticmethod(sdpa)

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, cfg.mlp_dim, cfg.eps) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if pixels.shape[2] < cfg.tubelet:  # an image: repeated into one tubelet
            pixels = pixels.repeat(1, 1, cfg.tubelet, 1, 1)
        x = self.patch_embed(pixels.to(self.patch_embed.proj.weight.dtype))
        t, h, w = pixels.shape[2] // cfg.tubelet, pixels.shape[3] // cfg.patch, pixels.shape[4] // cfg.patch
        ids = torch.arange(t * h * w, device=x.device)
        cos, sin = rope.tables(cfg.dim // cfg.heads, *rope.grid_positions(ids, h, w))
        cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)  # [N, 1, hd]
        for blk in self.blocks:
            x = blk(x, cos, sin, self.attend)
        return self.norm(x)


class MaskedPredictor(nn.Module):
    """Predicts the encoder's latents at target positions from the context tokens."""

    def __init__(self, cfg: PredictorConfig, enc: EncoderConfig):
        super().__init__()
        self.cfg, self.enc = cfg, enc
        self.predictor_embed = nn.Linear(enc.dim, cfg.dim)
        self.mask_tokens = nn.Parameter(torch.zeros(cfg.num_mask_tokens, cfg.dim))
        self.predictor_blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, cfg.mlp_dim, cfg.eps) for _ in range(cfg.depth))
        self.predictor_norm = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.predictor_proj = nn.Linear(cfg.dim, enc.dim)

    def forward(self, context: torch.Tensor, context_ids: torch.Tensor, target_ids: torch.Tensor,
                grid: tuple[int, int] | None = None, mask_index: int = 1) -> torch.Tensor:
        """``context`` ``[B, Nc, enc.dim]`` (the encoder's tokens at ``context_ids`` ``[B, Nc]``);
        returns ``[B, Nt, enc.dim]`` for ``target_ids`` ``[B, Nt]``. ``grid``: (rows, columns) of
        the clip's token grid (default: the checkpoint's crop)."""
        B, n_ctx = context_ids.shape
        x = self.predictor_embed(context)
        target = self.mask_tokens[mask_index % self.cfg.num_mask_tokens].to(x.dtype).expand(B, target_ids.shape[1], -1)
        x = torch.cat([x, target], 1)
        ids = torch.cat([context_ids, target_ids], 1)
        order = torch.argsort(ids, dim=1)
        ids = torch.gather(ids, 1, order)
        x = torch.gather(x, 1, order.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        h, w = grid or (self.enc.grid, self.enc.grid)
        cos, sin = rope.tables(self.cfg.dim // self.cfg.heads, *rope.grid_positions(ids, h, w))
        cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)  # [B, N, 1, hd]: per row
        for blk in self.predictor_blocks:
            x = blk(x, cos, sin)
        x = self.predictor_norm(x)
        x = torch.gather(x, 1, torch.argsort(order, dim=1).unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return self.predictor_proj(x[:, n_ctx:])


class KVCache:
    """One rollout's K/V: ``[layers, 2, B, heads, frames * tokens_per_frame, head_dim]``,
    allocated once at its full size (static addresses: a whole-loop CUDA graph can own it)."""

    def __init__(self, cfg: ACConfig, rows: int, frames: int, tokens_per_frame: int, dtype, device):
        hd = cfg.dim // cfg.heads
        self.buf = torch.empty((cfg.depth, 2, rows, cfg.heads, frames * tokens_per_frame, hd), dtype=dtype, device=device)
        self.frames, self.tokens_per_frame = frames, tokens_per_frame

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buf[i, 0], self.buf[i, 1]

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


class ACPredictor(nn.Module):
    """Per frame the tokens are [action, state, frame tokens]; attention is block-causal by frame;
    frame tokens get RoPE (frame index, row, column), action and state tokens the frame index in
    the depth chunk only. Outputs the frame tokens, normed, projected back to the encoder width."""

    def __init__(self, cfg: ACConfig, enc: EncoderConfig, use_extrinsics: bool = True):
        super().__init__()
        self.cfg, self.enc = cfg, enc
        self.predictor_embed = nn.Linear(enc.dim, cfg.dim)
        self.action_encoder = nn.Linear(cfg.action_dim, cfg.dim)
        self.state_encoder = nn.Linear(cfg.action_dim, cfg.dim)
        if use_extrinsics:  # present in the checkpoints, unused by the released model
            self.extrinsics_encoder = nn.Linear(cfg.action_dim - 1, cfg.dim)
        self.predictor_blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, cfg.mlp_dim, cfg.eps) for _ in range(cfg.depth))
        self.predictor_norm = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.predictor_proj = nn.Linear(cfg.dim, enc.dim)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def tokens_per_frame(self) -> int:
        return self.cfg.cond_tokens + self.enc.tokens_per_tubelet

    def frame_tables(self, t: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) ``[tokens_per_frame, 1, head_dim]`` for frame ``t`` (cached: a rollout step
        builds nothing on the host but the first time)."""
        key = (t, dtype, str(device))
        got = self._tables.get(key)
        if got is None:
            g, hd = self.enc.grid, self.cfg.dim // self.cfg.heads
            ids = torch.arange(g * g, device=device)
            _, rows, cols = rope.grid_positions(ids, g, g)
            depth = torch.full((g * g,), float(t), device=device)
            cf, sf = rope.tables(hd, depth, rows, cols)
            cc, sc = rope.tables(hd, torch.full((self.cfg.cond_tokens,), float(t), device=device), None, None)
            got = self._tables[key] = (torch.cat([cc, cf]).unsqueeze(1).to(dtype), torch.cat([sc, sf]).unsqueeze(1).to(dtype))
        return got

    def _tokens(self, frames: torch.Tensor, actions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """``[..., P, enc.dim]``, ``[..., 7]`` x2 -> ``[..., 2 + P, dim]`` (a fresh tensor: a compiled
        block would copy a view, ``owned``)."""
        x = self.predictor_embed(frames)
        a = self.action_encoder(actions.to(x.dtype)).unsqueeze(-2)
        s = self.state_encoder(states.to(x.dtype)).unsqueeze(-2)
        return torch.cat([a, s, x], -2)

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor_proj(self.predictor_norm(x[..., self.cfg.cond_tokens:, :]))

    def forward(self, frames: torch.Tensor, actions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Every frame at once (the reference's forward): ``frames`` ``[B, T * P, enc.dim]``,
        ``actions`` / ``states`` ``[B, T, 7]`` -> ``[B, T * P, enc.dim]``."""
        B, T = actions.shape[:2]
        x = self._tokens(frames.view(B, T, -1, frames.shape[-1]), actions, states)
        F_ = x.shape[2]
        x = x.flatten(1, 2)
        tabs = [self.frame_tables(t, x.dtype, x.device) for t in range(T)]
        cos, sin = torch.cat([c for c, _ in tabs]), torch.cat([s for _, s in tabs])
        frame_of = torch.arange(T * F_, device=x.device) // F_
        attend = partial(sdpa, mask=frame_of.unsqueeze(1) >= frame_of.unsqueeze(0))  # block-causal by frame
        for blk in self.predictor_blocks:
            x = blk(x, cos, sin, attend)
        return self._out(x.view(B, T, F_, -1)).flatten(1, 2)

    def new_cache(self, rows: int, frames: int, dtype=None, device=None) -> KVCache:
        w = self.predictor_proj.weight
        return KVCache(self.cfg, rows, frames, self.tokens_per_frame, dtype or w.dtype, device or w.device)

    def step(self, frame: torch.Tensor, action: torch.Tensor, state: torch.Tensor, cache: KVCache, t: int) -> torch.Tensor:
        """Frame ``t`` of a rollout: its 2 + P tokens only, attending to the cached frames < t.
        ``frame`` ``[B, P, enc.dim]``, ``action`` / ``state`` ``[B, 7]`` -> the prediction of frame
        t + 1, ``[B, P, enc.dim]`` (before the rollout's layer norm)."""
        return self.step_many(frame, action, state, [(cache, t)])

    def step_many(self, frame: torch.Tensor, action: torch.Tensor, state: torch.Tensor,
                  segments: list[tuple[KVCache, int]]) -> torch.Tensor:
        """``step`` for several rollouts at once: the rows of ``frame`` / ``action`` / ``state`` are
        the rollouts' rows in ``segments`` order, each rollout at its own frame ``t``."""
        for cache, t in segments:
            if not 0 <= t < cache.frames:
                raise ValueError(f"frame {t} is past the cache's {cache.frames} frames")
        x = self._tokens(frame, action, state)
        tabs = [self.frame_tables(t, x.dtype, x.device) for _, t in segments]
        if len(segments) == 1:
            cos, sin = tabs[0]
        else:  # [rows, F, 1, hd]: each row its rollout's frame index
            rows = [c.buf.shape[2] for c, _ in segments]
            cos = torch.cat([c.expand(r, -1, -1, -1) for (c, _), r in zip(tabs, rows, strict=True)])
            sin = torch.cat([s.expand(r, -1, -1, -1) for (_, s), r in zip(tabs, rows, strict=True)])
        for i, blk in enumerate(self.predictor_blocks):
            x = blk(x, cos, sin, CachedAttend([(*c.layer(i), t * c.tokens_per_frame) for c, t in segments], x.shape[1]))
        return self._out(x)


class CachedAttend:
    """``Attend`` through per-rollout K/V caches. ``segments``: per segment of the batch's rows (in
    order), that layer's K / V buffers ``[rows, heads, capacity, head_dim]`` and where the new
    ``tokens`` go: their K/V are written at ``[start, start + tokens)`` and their queries attend to
    everything before ``start + tokens`` (a rollout step: earlier frames' K/V never change).
    Several segments are several rollouts at different frames in one batch: attention per segment.
    With one segment, ``kv_out`` names the slots so a block's first half can write K/V there itself."""

    def __init__(self, segments: list[tuple[torch.Tensor, torch.Tensor, int]], tokens: int):
        self.segments, self.tokens = segments, tokens
        self.kv_out: tuple[torch.Tensor, torch.Tensor] | None = None
        if len(segments) == 1:
            kc, vc, start = segments[0]
            self.kv_out = (kc[:, :, start:start + tokens].transpose(1, 2), vc[:, :, start:start + tokens].transpose(1, 2))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        N = self.tokens
        in_place = self.kv_out is not None and k is self.kv_out[0]
        outs, row = [], 0
        for kc, vc, start in self.segments:
            rows = slice(row, row + kc.shape[0])
            row += kc.shape[0]
            if not in_place:
                kc[:, :, start:start + N] = k[rows].transpose(1, 2)
                vc[:, :, start:start + N] = v[rows].transpose(1, 2)
            outs.append(F.scaled_dot_product_attention(q[rows].transpose(1, 2), kc[:, :, :start + N],
                                                       vc[:, :, :start + N]).transpose(1, 2))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def warm_compiled(enc: Encoder | None, pred: MaskedPredictor | None, ac: ACPredictor | None) -> None:
    """Compile the pieces of the networks under ``compile_blocks`` now (a node group's start)
    rather than in the first requests, tens of seconds each on a GPU: each network on a small input
    at one row and two, under inference mode and under no_grad (the nodes and the loop graphs' two);
    the AC predictor also with two rollouts at different frames in one step (per-row RoPE tables)."""
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            for rows in (1, 2):
                if enc is not None:
                    c, w = enc.cfg, enc.norm.weight
                    enc(torch.zeros(rows, c.in_chans, c.tubelet, c.crop, c.crop, dtype=w.dtype, device=w.device))
                if pred is not None:
                    w = pred.predictor_norm.weight
                    ids = torch.arange(pred.enc.tokens_per_tubelet, device=w.device).expand(rows, -1)
                    half = ids.shape[1] // 2
                    pred(torch.zeros(rows, half, pred.enc.dim, dtype=w.dtype, device=w.device), ids[:, :half], ids[:, half:])
                if ac is not None:
                    w = ac.predictor_norm.weight
                    frame = torch.zeros(rows, ac.enc.tokens_per_tubelet, ac.enc.dim, dtype=w.dtype, device=w.device)
                    pose = torch.zeros(rows, ac.cfg.action_dim, device=w.device)
                    caches = [ac.new_cache(1, 2) for _ in range(rows)]
                    ac.step_many(frame, pose, pose, [(caches[0], 0)] if rows == 1 else [(caches[0], 1), (caches[1], 0)])
