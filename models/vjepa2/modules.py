"""The three networks: the video encoder, the masked predictor and the action-conditioned (AC)
predictor. Parameter names follow the official ``.pt`` layout (fused ``qkv``), so those
checkpoints load as they are (after prefix clean-up); ``weights.py`` maps the Hugging Face one.

All blocks are pre-LayerNorm ViT blocks: fused qkv (with bias) -> 3-D RoPE -> SDPA -> proj, and
an exact-erf GELU MLP.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mstar.models.vjepa2 import rope
from mstar.models.vjepa2.config import ACConfig, EncoderConfig, PredictorConfig

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def sdpa_order(names: tuple[str, ...] | None):
    """SDPA kernels tried in this order (the first that takes the inputs runs); None: torch's
    choice. cuDNN's attention can beat FlashAttention-2 on Hopper; measure before choosing."""
    if not names:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPA_BACKENDS[n] for n in names], set_priority=True)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
                cache: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None) -> torch.Tensor:
        """``cache``: per segment of the batch's rows (in order), that layer's K / V buffers
        ``[rows, heads, capacity, head_dim]`` and where the new tokens go: their K/V are written at
        ``[start, start + N)`` and their queries attend to everything before ``start + N`` (a
        rollout step: earlier frames' K/V never change). Several segments are several rollouts
        at different frames in one batch: one projection for all, attention per segment."""
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            outs, row = [], 0
            for kc, vc, start in cache:
                rows = slice(row, row + kc.shape[0])
                row += kc.shape[0]
                kc[:, :, start:start + N] = k[rows]
                vc[:, :, start:start + N] = v[rows]
                outs.append(F.scaled_dot_product_attention(q[rows], kc[:, :, :start + N], vc[:, :, :start + N]))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.proj(out.transpose(1, 2).reshape(B, N, C))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, mlp_dim)

    def forward(self, x, cos, sin, mask=None, cache=None):
        x = x + self.attn(self.norm1(x), cos, sin, mask, cache)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        k = (cfg.tubelet, cfg.patch, cfg.patch)
        self.proj = nn.Conv3d(cfg.in_chans, cfg.dim, kernel_size=k, stride=k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class Encoder(nn.Module):
    """Pixels ``[B, C, T, H, W]`` (normalised) -> ``[B, T/tubelet * H/patch * W/patch, dim]``."""

    #: SDPA kernel order (``sdpa_order``), None: torch's choice
    sdpa: tuple[str, ...] | None = None

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
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        with sdpa_order(self.sdpa):
            for blk in self.blocks:
                x = blk(x, cos, sin)
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
        cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)  # [B, 1, N, hd]: per row
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

    sdpa: tuple[str, ...] | None = None  # as Encoder.sdpa

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
        """(cos, sin) ``[tokens_per_frame, head_dim]`` for frame ``t`` (cached: a rollout step
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
            got = self._tables[key] = (torch.cat([cc, cf]).to(dtype), torch.cat([sc, sf]).to(dtype))
        return got

    def _tokens(self, frames: torch.Tensor, actions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """``[B, T, P, enc.dim]``, ``[B, T, 7]`` x2 -> ``[B, T, 2 + P, dim]``."""
        x = self.predictor_embed(frames)
        a = self.action_encoder(actions.to(x.dtype)).unsqueeze(2)
        s = self.state_encoder(states.to(x.dtype)).unsqueeze(2)
        return torch.cat([a, s, x], 2)

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
        mask = frame_of.unsqueeze(1) >= frame_of.unsqueeze(0)  # block-causal by frame
        for blk in self.predictor_blocks:
            x = blk(x, cos, sin, mask)
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
        x = self._tokens(frame.unsqueeze(1), action.unsqueeze(1), state.unsqueeze(1))[:, 0]
        tabs = [self.frame_tables(t, x.dtype, x.device) for _, t in segments]
        if len(segments) == 1:
            cos, sin = tabs[0]
        else:  # [rows, 1, F, hd]: each row its rollout's frame index
            rows = [c.buf.shape[2] for c, _ in segments]
            cos = torch.cat([c.expand(r, -1, -1) for (c, _), r in zip(tabs, rows, strict=True)]).unsqueeze(1)
            sin = torch.cat([s.expand(r, -1, -1) for (_, s), r in zip(tabs, rows, strict=True)]).unsqueeze(1)
        with sdpa_order(self.sdpa):
            for i, blk in enumerate(self.predictor_blocks):
                x = blk(x, cos, sin, cache=[(*c.layer(i), t * c.tokens_per_frame) for c, t in segments])
        return self._out(x)
