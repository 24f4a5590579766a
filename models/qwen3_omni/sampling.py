"""Per-row sampling as transformers' warpers do it (temperature, then top-k, then top-p), greedy at
temperature 0; each row draws from its request's own generator (seeded requests repeat)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.services.engines.batch import h2d


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


GREEDY = Sampling()

def _warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[R, V] logits of rows sharing ``s`` -> warped logits (-inf outside top-k / top-p)."""
    logits = logits / s.temperature
    if s.top_k > 0:
        k = min(s.top_k, logits.shape[-1])
        kth = torch.topk(logits, k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - s.top_p)
        drop[..., -1:] = False  # keep at least one
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, sampling: list[Sampling] | None,
           generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """logits [B, V] -> ids [B] (int64, on the logits' device). Rows with the same knobs are warped
    together; unseeded rows (generator None) draw together too; a seeded row draws from its own
    generator (one small draw each)."""
    out = logits.argmax(-1)
    if sampling is None or all(s.greedy for s in sampling):
        return out
    groups: dict[Sampling, list[int]] = {}
    for row, s in enumerate(sampling):
        if not s.greedy:
            groups.setdefault(s, []).append(row)
    for s, rows in groups.items():
        whole = len(rows) == logits.shape[0]  # (the usual case: no index, no gather)
        idx = None if whole else h2d(torch.tensor(rows), logits.device)
        probs = _warp((logits if whole else logits[idx]).float(), s).softmax(-1)
        gens = [generators[r] if generators is not None else None for r in rows]
        shared = [i for i, g in enumerate(gens) if g is None]
        if len(shared) == len(rows):  # every row unseeded: one draw
            picked = torch.multinomial(probs, 1)[:, 0]
            if whole:
                out = picked
            else:
                out[idx] = picked
        elif shared:  # (device indices: a host list as an index would wait for the device)
            at = h2d(torch.tensor(shared), logits.device)
            out[h2d(torch.tensor([rows[i] for i in shared]), logits.device)] = torch.multinomial(probs[at], 1)[:, 0]
        for i, g in enumerate(gens):
            if g is not None:
                out[rows[i]] = torch.multinomial(probs[i : i + 1], 1, generator=g)[0, 0]
    return out
