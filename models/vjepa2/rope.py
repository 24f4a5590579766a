"""3-D rotary position embedding as V-JEPA 2 applies it.

The head dim splits into three rotated chunks of ``2 * ((head_dim // 3) // 2)`` (depth, height,
width) and an unrotated rest. Within a chunk of size c, pairs (x[2j], x[2j+1]) rotate, but the
sin/cos vectors are the c/2 frequencies *tiled* twice ([f0..f_{c/2-1}, f0..f_{c/2-1}]) rather
than interleaved, so pair j uses the frequency of index 2j mod c/2. The released checkpoints were
trained that way, so it stays.

Everything here builds one (cos, sin) table over the whole head dim per token (the rest: cos 1,
sin 0), so applying it is one fused expression per tensor instead of three rotations and a cat.
"""

from __future__ import annotations

import torch

THETA = 10_000.0


def chunk(head_dim: int) -> int:
    return 2 * ((head_dim // 3) // 2)


def _omega(c: int, device) -> torch.Tensor:
    # the same float32 ops as the reference, so the angles agree bit for bit
    omega = torch.arange(c // 2, dtype=torch.float32, device=device)
    omega /= c / 2.0
    return 1.0 / THETA**omega


def _tiled(pos: torch.Tensor, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freq = pos.to(torch.float32).unsqueeze(-1) * omega
    cos, sin = freq.cos(), freq.sin()
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


def tables(head_dim: int, depth: torch.Tensor, height: torch.Tensor | None, width: torch.Tensor | None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each ``[*pos.shape, head_dim]`` float32, for per-token positions. ``height`` /
    ``width`` None: those chunks stay unrotated (the AC predictor's action and state tokens)."""
    c = chunk(head_dim)
    omega = _omega(c, depth.device)
    cos_parts, sin_parts = [], []
    for pos in (depth, height, width):
        if pos is None:
            cos_parts.append(torch.ones((*depth.shape, c), device=depth.device))
            sin_parts.append(torch.zeros((*depth.shape, c), device=depth.device))
        else:
            cos, sin = _tiled(pos, omega)
            cos_parts.append(cos)
            sin_parts.append(sin)
    rest = head_dim - 3 * c
    if rest:
        cos_parts.append(torch.ones((*depth.shape, rest), device=depth.device))
        sin_parts.append(torch.zeros((*depth.shape, rest), device=depth.device))
    return torch.cat(cos_parts, -1), torch.cat(sin_parts, -1)


def grid_positions(ids: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token index (row-major over frames, rows, columns) -> (frame, row, column)."""
    per_frame = height * width
    frame = ids // per_frame
    rem = ids - frame * per_frame
    row = rem // width
    return frame, row, rem - row * width


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_pairs(x) * sin
