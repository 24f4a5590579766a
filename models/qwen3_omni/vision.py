"""The Thinker's vision encoder (images and video frames): Conv3d patches, a learned position grid
resampled bilinearly to each image, 2-D rotary attention within each frame, and patch mergers
(2x2 patches -> one LLM token) at the end and after the DeepStack layers.

Pixels come as the processor makes them: one row of ``in_channels * temporal_patch * patch^2``
values per patch, patches of each ``merge x merge`` block consecutive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.qwen3_omni.config import VisionConfig
from mstar.models.qwen3_omni.layers import rotate_half


def block_positions(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """[sum(t*h*w), 2] (row, col) of each patch, in merge-block order, repeated per frame."""
    out = []
    for t, h, w in grid.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rc = torch.stack([rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()], -1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def _taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)  # align_corners=True
    floor = torch.floor(src)
    taps = floor.long()[:, None] + torch.arange(2)
    weights = (1 - (src[:, None] - floor[:, None] - torch.arange(2)).abs()).clamp(min=0)
    return taps.clamp(0, side - 1), weights


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cos, sin, mask):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        c, s = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class _Mlp(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = nn.Linear(dim, inner), nn.Linear(inner, dim)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6), nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = _Attention(c.hidden_size, c.num_heads)
        self.mlp = _Mlp(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, c: VisionConfig, postshuffle: bool):
        super().__init__()
        self.size = c.hidden_size * c.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.ln_q = nn.LayerNorm(self.size if postshuffle else c.hidden_size, eps=1e-6)
        self.mlp = nn.ModuleList([nn.Linear(self.size, self.size), nn.GELU(), nn.Linear(self.size, c.out_hidden_size)])

    def forward(self, x):
        x = self.ln_q(x.view(-1, self.size) if self.postshuffle else x).view(-1, self.size)
        for m in self.mlp:
            x = m(x)
        return x


class _PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        k = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.shape = (-1, c.in_channels, *k)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, x):
        return self.proj(x.view(self.shape).to(self.proj.weight.dtype)).view(x.shape[0], -1)


class VisionEncoder(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.cfg = c
        self.patch_embed = _PatchEmbed(c)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.side = int(c.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList([_Block(c) for _ in range(c.depth)])
        self.merger = _Merger(c, postshuffle=False)
        self.merger_list = nn.ModuleList([_Merger(c, postshuffle=True) for _ in c.deepstack_visual_indexes])
        spatial = c.hidden_size // c.num_heads // 2
        self.register_buffer("freqs", 1.0 / (c.rope_theta ** (torch.arange(0, spatial, 2, device="cpu").float() / spatial)),
                             persistent=False)

    def forward(self, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixels [patches, C*T*P*P], grid [images, 3] (t, h, w in patches) -> (one embedding per
        merged token [patches / merge^2, out_hidden], DeepStack features, one per index, same rows)."""
        c, dev = self.cfg, pixels.device
        rc = block_positions(grid.cpu(), c.spatial_merge_size)
        counts = (grid[:, 0] * grid[:, 1] * grid[:, 2]).cpu()
        heights = torch.repeat_interleave(grid[:, 1].cpu(), counts)
        widths = torch.repeat_interleave(grid[:, 2].cpu(), counts)
        ht, hw = _taps(rc[:, 0], heights, self.side)
        wt, ww = _taps(rc[:, 1], widths, self.side)
        idx = (ht[:, :, None] * self.side + wt[:, None, :]).reshape(-1, 4).to(dev)
        wts = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4).to(dev)
        x = self.patch_embed(pixels)
        x = x + (self.pos_embed(idx) * wts[:, :, None]).sum(1).to(x.dtype)
        f = rc.to(dev).float()[..., None] * self.freqs  # [N, 2, spatial/2]
        hw_freqs = torch.cat([f[:, 0], f[:, 1]], dim=-1)
        emb = torch.cat([hw_freqs, hw_freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        frame = torch.repeat_interleave(torch.arange(int(grid[:, 0].sum())), torch.repeat_interleave(
            grid[:, 1].cpu() * grid[:, 2].cpu(), grid[:, 0].cpu())).to(dev)
        mask = frame[:, None] == frame[None, :]
        deep = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, mask)
            if i in c.deepstack_visual_indexes:
                deep.append(self.merger_list[c.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deep
