"""Token sampling batched over requests with different parameters.

Order per row: allowed-token ranges -> repetition penalty -> (greedy argmax | temperature ->
top-k -> top-p -> min-p -> draw). Draws use the exponential-race trick (argmax of p / E with
E ~ Exp(1)), so a row with a seed draws its noise from its own ``torch.Generator`` and is
reproducible whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import IntEnum

import torch

from mstar.services.engines.batch import h2d


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF convention: > 1 discourages seen tokens
    seed: int | None = None
    allowed_token_ranges: tuple[tuple[int, int], ...] = ()  # half-open [a, b); empty means all
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    # per-output-position ranges: output i may only be drawn from allowed_token_cycle[i % len]
    # (interleaved codebooks, e.g. Orpheus' 7 SNAC code positions); replaces allowed_token_ranges
    allowed_token_cycle: tuple[tuple[tuple[int, int], ...], ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
        ]
        for a, b in self.allowed_token_ranges:
            checks.append((0 <= a < b, f"allowed_token_ranges: [{a}, {b}) is empty or negative"))
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{msg}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def at_output(self, index: int) -> SamplingParams:
        """The parameters that draw output number ``index`` (resolves allowed_token_cycle)."""
        if not self.allowed_token_cycle:
            return self
        ranges = self.allowed_token_cycle[index % len(self.allowed_token_cycle)]
        return replace(self, allowed_token_ranges=ranges, allowed_token_cycle=())


class FinishReason(IntEnum):
    STOP = 1  # a stop token was produced
    LENGTH = 2  # max_tokens reached


def check_stop(params: SamplingParams, token: int, num_output_tokens: int) -> FinishReason | None:
    if token in params.stop_token_ids:
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    return None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


# -- masks, each on a [B, V] tensor with per-row parameters --------------------------------
_RANGE_MASKS: dict[tuple, torch.Tensor] = {}  # (ranges, vocab, device) -> bool [V], built once


def _range_mask(ranges: tuple[tuple[int, int], ...], vocab: int, device: torch.device) -> torch.Tensor:
    key = (ranges, vocab, str(device))
    mask = _RANGE_MASKS.get(key)
    if mask is None:
        mask = torch.zeros(vocab, dtype=torch.bool)
        for a, b in ranges:
            mask[a:b] = True
        mask = _RANGE_MASKS[key] = mask.to(device)
    return mask


def apply_allowed_ranges(logits: torch.Tensor, ranges: Sequence[tuple[tuple[int, int], ...]]) -> torch.Tensor:
    """One masked fill for the whole batch; each distinct range set is a cached [V] mask."""
    rows = [i for i, rr in enumerate(ranges) if rr]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    keep = torch.stack([_range_mask(ranges[i], vocab, logits.device) for i in rows])
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~keep, float("-inf"))
    else:
        idx = h2d(torch.tensor(rows), logits.device)
        logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalties: Sequence[float]) -> torch.Tensor:
    """HF convention: a seen token's positive logit is divided by the penalty, a negative one
    multiplied. ``seen`` is a [B, V] bool mask; one fused pass over the batch."""
    pen = h2d(torch.tensor(penalties, dtype=logits.dtype), logits.device)[:, None]
    penalized = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, penalized, logits, out=logits)


class SeenTokens:
    """Per-sequence [V] masks of the ids a sequence holds, updated with only the ids added
    since the last step (a history is the sequence's own growing token list)."""

    def __init__(self) -> None:
        self._masks: dict[int, tuple[Sequence[int], int, torch.Tensor]] = {}

    def masks(self, histories: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
        rows = []
        for h in histories:
            entry = self._masks.get(id(h))
            if entry is None or entry[0] is not h or entry[1] > len(h):
                entry = (h, 0, torch.zeros(vocab, dtype=torch.bool, device=device))
            _, done, mask = entry
            if len(h) > done:
                mask[h2d(torch.tensor(h[done:]), device)] = True
            self._masks[id(h)] = (h, len(h), mask)
            rows.append(mask)
        if len(self._masks) > 4 * len(histories) + 256:  # forget sequences that left
            live = {id(h) for h in histories}
            self._masks = {k: v for k, v in self._masks.items() if k in live}
        return torch.stack(rows)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (0 keeps all)."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by probability) whose mass reaches ``top_p``."""
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(-1)
    floor = min_p[:, None] * probs.max(-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


class Sampler:
    def __init__(self) -> None:
        self._seen = SeenTokens()

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """logits [B, V] -> token ids [B] (int64, on logits' device)."""
        n = logits.shape[0]
        logits = logits.clone() if logits.dtype == torch.float32 else logits.float()  # masks write in place
        dev = logits.device
        apply_allowed_ranges(logits, [p.allowed_token_ranges for p in params])
        if histories is not None and any(p.repetition_penalty != 1.0 for p in params):
            seen = self._seen.masks(histories, logits.shape[-1], dev)
            apply_repetition_penalty(logits, seen, [p.repetition_penalty for p in params])
        out = logits.argmax(-1)
        if all(p.greedy for p in params):  # decided on the host: no device sync
            return out
        greedy = h2d(torch.tensor([p.greedy for p in params]), dev)
        temp = h2d(torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params]), dev)
        x = logits / temp[:, None]
        if any(p.top_k for p in params):
            x = apply_top_k(x, h2d(torch.tensor([p.top_k for p in params]), dev))
        if any(p.top_p < 1 for p in params):
            x = apply_top_p(x, h2d(torch.tensor([p.top_p for p in params]), dev))
        if any(p.min_p > 0 for p in params):
            x = apply_min_p(x, h2d(torch.tensor([p.min_p for p in params]), dev))
        probs = x.softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        gens = generators or [None] * n
        for row, g in enumerate(gens):
            if g is not None:
                noise[row] = torch.empty(probs.shape[-1], device=dev).exponential_(generator=g)
        drawn = (probs / noise).argmax(-1)
        return torch.where(greedy, out, drawn)
