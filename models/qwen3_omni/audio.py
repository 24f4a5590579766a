"""The Thinker's audio encoder: log-mel frames -> one embedding per ~80 ms.

Each audio is cut into chunks of ``2 * n_window`` mel frames (100: 1 s); three stride-2 convs
downsample every chunk on its own (13 rows per full chunk), sinusoidal positions restart per chunk,
and the transformer attends within windows of ``n_window_infer // (2 * n_window)`` chunks' rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.qwen3_omni.config import AudioConfig


def output_lengths(lengths: torch.Tensor, n_window: int = 50) -> torch.Tensor:
    """Rows the encoder makes from ``lengths`` mel frames (transformers' formula)."""
    chunk = n_window * 2
    rest = lengths % chunk
    after = (rest - 1) // 2 + 1
    return ((after - 1) // 2 + 1 - 1) // 2 + 1 + (lengths // chunk) * 13


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, device="cpu").float())
    t = torch.arange(length, device="cpu")[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, d = x.shape
        q, k, v = (p(x).view(n, self.heads, -1).transpose(0, 1) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(0, 1).reshape(n, d))


class _Layer(nn.Module):
    def __init__(self, c: AudioConfig):
        super().__init__()
        self.self_attn = _Attention(c.d_model, c.num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1, self.fc2 = nn.Linear(c.d_model, c.ffn_dim), nn.Linear(c.ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, c: AudioConfig):
        super().__init__()
        self.cfg = c
        ch = c.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv_out = nn.Linear(ch * ((((c.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2), c.d_model, bias=False)
        self.layers = nn.ModuleList([_Layer(c) for _ in range(c.num_layers)])
        self.ln_post = nn.LayerNorm(c.d_model)
        self.proj1 = nn.Linear(c.d_model, c.d_model)
        self.proj2 = nn.Linear(c.d_model, c.output_dim)
        self.register_buffer("positions", sinusoids(c.max_source_positions, c.d_model), persistent=False)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """features [mel, sum(lengths)] (every audio's frames one after the other), lengths [A]
        -> embeddings [sum(output_lengths(lengths)), output_dim]."""
        c = self.cfg
        chunk = 2 * c.n_window
        sizes: list[int] = []
        for n in lengths.tolist():
            sizes += [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
        pieces = features.T.split(sizes, dim=0)
        longest = max(sizes)
        padded = torch.stack([F.pad(p, (0, 0, 0, longest - p.shape[0])) for p in pieces]).transpose(1, 2)
        h = padded.unsqueeze(1).to(self.conv2d1.weight.dtype)
        h = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(h))))))
        b, ch, f, t = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(b, t, ch * f)) + self.positions[:t].to(h.dtype)
        valid = output_lengths(torch.tensor(sizes), c.n_window)
        keep = (torch.arange(t)[None, :] < valid[:, None]).reshape(-1).nonzero()[:, 0].to(h.device)
        x = h.reshape(b * t, -1).index_select(0, keep)
        mask = self._windows(lengths, int(valid.max()), x.device)
        for layer in self.layers:
            x = layer(x, mask)
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))

    def _windows(self, lengths: torch.Tensor, longest_chunk_rows: int, device) -> torch.Tensor:
        """Block-diagonal mask: rows attend within their inference window."""
        c = self.cfg
        window = longest_chunk_rows * (c.n_window_infer // (2 * c.n_window))
        ids: list[int] = []
        w = 0
        for rows in output_lengths(lengths, c.n_window).tolist():
            for start in range(0, rows, window):
                ids += [w] * min(window, rows - start)
                w += 1
        seg = torch.tensor(ids, device=device)
        return seg[:, None] == seg[None, :]
