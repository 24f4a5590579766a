"""The understanding encoder: SigLIP so400m/14 as a NaViT (images at their own aspect ratio, each
patch's learned position looked up at row·70+col of a 70x70 table), the patch embedding a Linear
over 14·14·3 = 588 pixel values, then the connector (Linear -> GELU-tanh -> Linear) into the LLM's
width plus a fixed 2-D sin-cos table at the same indices."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.bagel.config import BagelConfig, ViTConfig


def sincos_2d(dim: int, side: int) -> torch.Tensor:
    """[side², dim]: row r·side+c holds sin | cos of the column c over the first half and of the
    row r over the second (the MAE / DiT table, in float64 then rounded to float32)."""
    def one_d(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid = np.arange(side, dtype=np.float32)
    cols, rows = np.meshgrid(grid, grid)  # [side, side] each: the column and the row index
    table = np.concatenate([one_d(dim // 2, cols), one_d(dim // 2, rows)], axis=1)
    return torch.from_numpy(table).float()


def patch_position_ids(height: int, width: int, patch: int, per_side: int) -> torch.Tensor:
    """Row-major patch grid of an image, indexed into a per_side x per_side table."""
    rows, cols = torch.arange(height // patch), torch.arange(width // patch)
    return (rows[:, None] * per_side + cols).flatten()


def patchify(image: torch.Tensor, patch: int) -> torch.Tensor:
    """[C, H, W] -> [(H/p)·(W/p), p·p·C], each patch's values ordered (row, col, channel)."""
    c, h, w = image.shape
    x = image.reshape(c, h // patch, patch, w // patch, patch)
    return torch.einsum("chpwq->hwpqc", x).reshape(-1, patch * patch * c)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        h = cfg.hidden_size
        self.layer_norm1 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))
        self.layer_norm2 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(h, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, h)
        self.num_heads = cfg.num_heads

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x: the images' patches concatenated; each image attends within itself."""
        n, width = x.shape
        d = width // self.num_heads
        h = self.layer_norm1(x)
        q, k, v = (p(h).view(n, self.num_heads, d).transpose(0, 1) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = torch.cat([F.scaled_dot_product_attention(qi, ki, vi) for qi, ki, vi in
                         zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1), strict=True)], dim=1)
        x = x + self.out_proj(out.transpose(0, 1).reshape(n, width))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class VisionEncoder(nn.Module):
    """Patches of several images -> LLM-width embeddings (connector and position table included)."""

    def __init__(self, cfg: BagelConfig):
        super().__init__()
        v = cfg.vit
        self.patch = v.patch_size
        self.per_side = cfg.vit_max_patches_per_side
        self.patch_embedding = nn.Linear(v.num_channels * v.patch_size ** 2, v.hidden_size)
        self.position_embedding = nn.Embedding(v.max_patches_per_side ** 2, v.hidden_size)
        self.layers = nn.ModuleList(EncoderLayer(v) for _ in range(v.num_layers))
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.connector_fc1 = nn.Linear(v.hidden_size, cfg.llm.hidden_size)
        self.connector_fc2 = nn.Linear(cfg.llm.hidden_size, cfg.llm.hidden_size)
        self.register_buffer("pos_table", sincos_2d(cfg.llm.hidden_size, self.per_side), persistent=False)

    def encode(self, patches: torch.Tensor, position_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """SigLIP's last hidden state (post-layernorm) of the packed images."""
        x = self.patch_embedding(patches) + self.position_embedding(position_ids)
        for layer in self.layers:
            x = layer(x, lengths)
        return self.post_layernorm(x)

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """Normalised images [3, H, W] (H, W multiples of 14) -> each one's [tokens, llm hidden]."""
        dtype = self.patch_embedding.weight.dtype
        patches = [patchify(im.to(dtype), self.patch) for im in images]
        ids = [patch_position_ids(im.shape[1], im.shape[2], self.patch, self.per_side).to(im.device) for im in images]
        lengths = [p.shape[0] for p in patches]
        ids_all = torch.cat(ids)
        x = self.encode(torch.cat(patches), ids_all, lengths)
        x = self.connector_fc2(F.gelu(self.connector_fc1(x), approximate="tanh")) + self.pos_table[ids_all].to(x.dtype)
        return list(x.split(lengths))
