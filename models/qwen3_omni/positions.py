"""M-RoPE positions of a prompt: ``[3, L]`` (temporal, height, width) and the offset decoding
continues from, as transformers' ``get_rope_index`` assigns them (without audio-in-video).

Text and audio rows count up one by one on all three axes. An image's (or video's) merged tokens
take ``start + (t * seconds_per_t * position_id_per_seconds, row, col)``; the text after it starts at
the largest position so far + 1. Without images or videos every row is sequential (so an
audio-only prompt is too). Decoding token i (0 = the first after the prompt) sits at
``L + i + delta`` on every axis.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_positions(ids: Sequence[int], *, audio_id: int, image_id: int, video_id: int,
                    audio_rows: Sequence[int] = (), image_grids: Sequence[Sequence[int]] = (),
                    video_grids: Sequence[Sequence[int]] = (), video_seconds: Sequence[float] = (),
                    merge: int = 2, per_second: int = 25) -> tuple[torch.Tensor, int]:
    """-> (positions [3, L] float32, delta). ``audio_rows``: encoder rows per audio (checked
    against the placeholders); grids in patches (t, h, w) before merging."""
    n = len(ids)
    if not image_grids and not video_grids:
        pos = torch.arange(n, dtype=torch.float32).expand(3, n).clone()
        return pos, 0
    out = torch.empty(3, n, dtype=torch.float32)
    nxt, i = 0.0, 0
    media = {audio_id: iter(audio_rows), image_id: iter(image_grids), video_id: iter(video_grids)}
    seconds = iter(video_seconds)
    while i < n:
        tok = ids[i]
        if tok not in media:
            out[:, i] = nxt
            nxt += 1
            i += 1
            continue
        j = i
        while j < n and ids[j] == tok:
            j += 1
        if tok == audio_id:
            rows = next(media[tok], None)
            if rows is not None and rows != j - i:
                raise ValueError(f"audio placeholder run of {j - i} tokens, the encoder makes {rows}")
            out[:, i:j] = nxt + torch.arange(j - i, dtype=torch.float32)
            nxt += j - i
        else:
            grid = next(media[tok], None)
            if grid is None:
                raise ValueError("more image/video placeholder runs than grids")
            t, h, w = (int(x) for x in grid)
            gh, gw = h // merge, w // merge
            if t * gh * gw != j - i:
                raise ValueError(f"placeholder run of {j - i} tokens, grid {list(grid)} makes {t * gh * gw}")
            step = per_second * (1.0 if tok == image_id else float(next(seconds)))
            tt = (torch.arange(t, dtype=torch.float32) * step).view(-1, 1).expand(t, gh * gw).reshape(-1)
            hh = torch.arange(gh, dtype=torch.float32).view(1, -1, 1).expand(t, gh, gw).reshape(-1)
            ww = torch.arange(gw, dtype=torch.float32).view(1, 1, -1).expand(t, gh, gw).reshape(-1)
            block = torch.stack([tt, hh, ww]) + nxt
            out[:, i:j] = block
            nxt = float(block.max()) + 1
        i = j
    return out, int(out.max().item()) + 1 - n


def decode_positions(length: int, delta: int, steps: int = 1, start: int = 0) -> torch.Tensor:
    """[3, steps] positions of decode tokens ``start`` .. ``start + steps - 1`` after a prompt of ``length``."""
    p = torch.arange(start, start + steps, dtype=torch.float32) + length + delta
    return p.expand(3, steps).clone()
