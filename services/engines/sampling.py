"""Token sampling batched over requests with different parameters.

Order per row: allowed-token ranges -> repetition penalty -> (greedy argmax | temperature ->
top-k -> top-p -> min-p -> draw). A draw is inverse-CDF sampling with one uniform per row over
the kept tokens in vocabulary order (whatever sort decided which tokens are kept); a seeded
row's uniform is a hash of (seed, output index), so it is reproducible whatever else shares the
batch (and whichever path samples it: torch, the fused kernels), on any device, pipelined or not.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from functools import cached_property

import numpy as np
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

    @cached_property
    def draw_row(self) -> tuple[float, float, float, float, float]:
        """(temperature or 1 when greedy, top_p, min_p, top_k, greedy) for the sampler's
        per-row parameter tensor: built once, not per step."""
        return (self.temperature if self.temperature > 0 else 1.0, self.top_p, self.min_p, float(self.top_k),
                float(self.greedy))

    def at_output(self, index: int) -> SamplingParams:
        """The parameters that draw output number ``index`` (resolves allowed_token_cycle)."""
        if not self.allowed_token_cycle:
            return self
        return self._cycle[index % len(self.allowed_token_cycle)]

    @cached_property
    def _cycle(self) -> tuple[SamplingParams, ...]:  # per-step hot path: resolved once
        return tuple(replace(self, allowed_token_ranges=r, allowed_token_cycle=()) for r in self.allowed_token_cycle)


class FinishReason(IntEnum):
    STOP = 1  # a stop token was produced
    LENGTH = 2  # max_tokens reached


def check_stop(params: SamplingParams, token: int, num_output_tokens: int) -> FinishReason | None:
    if token in params.stop_token_ids:
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    return None


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


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor,
                             penalties: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """HF convention: a seen token's positive logit is divided by the penalty, a negative one
    multiplied. ``seen`` is a [B, V] bool mask; one fused pass over the batch. ``penalties``:
    one per row (a list, or a tensor already on the device)."""
    if not isinstance(penalties, torch.Tensor):
        penalties = h2d(torch.tensor(penalties), logits.device)
    pen = penalties.to(logits.dtype)[:, None]
    penalized = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, penalized, logits, out=logits)


def filtered_probs(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None,
                   sort: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities of scaled logits ``x`` [B, V] with top-k (0 = off), top-p (the smallest
    prefix by probability whose mass reaches it) and min-p (below min_p x the row's top
    probability) set to 0. With ``sort`` (needed by top-k / top-p) they come in descending
    order with the permutation as the second result; else in vocabulary order and None."""
    order = drop = None
    if sort:
        x, order = x.sort(dim=-1, descending=True)
    probs = x.softmax(-1)
    if sort:
        rank = torch.arange(x.shape[-1], device=x.device)
        drop = (top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None])
        drop |= (row_cumsum(probs) - probs) >= top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays
    if min_p is not None:
        below = probs < min_p[:, None] * probs.max(-1, keepdim=True).values
        drop = below if drop is None else drop.logical_or_(below)
    return (probs if drop is None else probs.masked_fill_(drop, 0)), order


def row_cumsum(x: torch.Tensor, dtype: torch.dtype | None = None, padded: bool = False) -> torch.Tensor:
    """``x.cumsum(-1)`` for [B, V] rows, in blocks: a scan along the last dimension runs on
    about one CUDA block per 32 rows, so 16 rows of a 128k vocabulary scan serially in one
    block (hundreds of µs). Each row is cut into ~sqrt(V) blocks that scan in parallel, then
    offset by the running sum of the blocks before them (same sums, another order). With
    ``padded`` the result may run past V with the row's total (contiguous, no slicing copy)."""
    b, v = x.shape
    width = 1 << max(7, (v.bit_length() + 1) // 2)  # a power of two near sqrt(V), >= 128
    if v <= 2 * width:
        return x.cumsum(-1, dtype=dtype)
    n = -(-v // width)
    if n * width != v:
        x = torch.nn.functional.pad(x, (0, n * width - v))
    inner = x.view(b, n, width).cumsum(-1, dtype=dtype)
    totals = inner[:, :, -1]
    inner += (totals.cumsum(-1) - totals)[:, :, None]
    return inner.view(b, n * width) if padded else inner.view(b, n * width)[:, :v]


# -- the sampler ----------------------------------------------------------------------------
#: the widest allowed set the fused sampler takes (one program holds a row in registers)
FUSED_MAX_WIDTH = 8192

_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, counter: int) -> float:
    """A uniform in [0, 1) fixed by (seed, counter): splitmix64 of both. Draw number
    ``counter`` of a seeded request depends on nothing else (batch, device, step timing)."""
    z = (seed * 0x9E3779B97F4A7C15 + counter * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


_SPLITMIX = tuple(np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03, 0x632BE59BD9B4E019, 0xBF58476D1CE4E5B9,
                                           0x94D049BB133111EB))


def seeded_uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """``seeded_uniform`` of each (seed, counter) pair at once (uint64 arithmetic wraps like
    the masked Python ints): equal to it bit for bit."""
    s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)
    c = np.array([x & _MASK64 for x in counters], dtype=np.uint64)
    c1, c2, c3, c4, c5 = _SPLITMIX
    z = s * c1 + c * c2 + c3
    z = (z ^ (z >> np.uint64(30))) * c4
    z = (z ^ (z >> np.uint64(27))) * c5
    return ((z ^ (z >> np.uint64(31))) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass(frozen=True)
class SamplePlan:
    """What ``Sampler.plan`` decided for a batch of rows (``Sampler.sample`` carries it out)."""

    host: np.ndarray  # float64 [3 or 9, B]: the per-row numbers the device half reads
    vocab: int  # width of the logits it samples
    path: str  # 'full' | 'fused' (sample_triton) | 'torch'
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # each row's allowed ranges
    compacts: bool  # every row has allowed ranges, small enough to gather them first
    penalize: bool  # a row has a repetition penalty and a tracked sequence
    greedy: bool  # every row greedy (torch path: argmax only)
    sorts: bool  # a row uses top-k / top-p
    min_p: bool  # a row uses min-p
    any_greedy: bool
    columns: torch.Tensor | None  # the restricted head's token ids, if the logits are restricted

    @property
    def constrained(self) -> bool:
        """Every row has allowed ranges."""
        return bool(self.ranges) and all(self.ranges)


class _RangeTable:
    """Every distinct allowed-range set seen so far as a row of token ids on the device
    ([sets, width], padded with -1), so a batch whose rows all have small allowed sets is
    compacted to [B, width] by one gather before any other work."""

    def __init__(self) -> None:
        self.sets: dict[tuple[tuple[int, int], ...], int] = {}
        self.table: torch.Tensor | None = None
        # the same range tuples come back every step: look them up by identity (hashing a
        # tuple of tuples per row per step adds up), keeping each alive so ids are not reused
        self._by_obj: dict[int, tuple[int, tuple]] = {}

    def ids(self, ranges: Sequence[tuple[tuple[int, int], ...]], device: torch.device) -> list[int]:
        by_obj = self._by_obj
        if self.table is not None and self.table.device == device:
            try:
                return [by_obj[id(r)][0] for r in ranges]
            except KeyError:
                pass
        out = self._ids(ranges, device)
        for r, i in zip(ranges, out, strict=True):
            by_obj[id(r)] = (i, r)
        return out

    def _ids(self, ranges: Sequence[tuple[tuple[int, int], ...]], device: torch.device) -> list[int]:
        new = [r for r in dict.fromkeys(ranges) if r not in self.sets]
        if new or self.table is None or self.table.device != device:
            for r in new:
                self.sets[r] = len(self.sets)
            # ascending ids (the draw's order is the vocabulary's), overlaps counted once
            rows = [torch.cat([torch.arange(a, b) for a, b in r]).unique() for r in self.sets]
            width = max(len(x) for x in rows)
            table = torch.full((len(rows), width), -1, dtype=torch.int64)
            for i, x in enumerate(rows):
                table[i, : len(x)] = x
            self.table = table.to(device)
        return [self.sets[r] for r in ranges]

    def positions(self, columns: torch.Tensor) -> torch.Tensor:
        """The table with each token id replaced by its column in logits computed for the
        sorted ids ``columns`` only (padding stays -1; every listed id must be a column)."""
        assert self.table is not None
        cached = getattr(self, "_positions", None)
        if cached is not None and cached[0] is columns and cached[1] is self.table:
            return cached[2]
        ids = self.table.clamp(min=0)
        pos = torch.searchsorted(columns, ids)
        if bool((columns[pos.clamp(max=len(columns) - 1)] != ids)[self.table >= 0].any()):
            raise ValueError("an allowed token id has no column in the restricted logits")
        pos = pos.masked_fill(self.table < 0, -1)
        self._positions = (columns, self.table, pos)
        return pos


class Sampler:
    """Samples a batch of rows with their own parameters, on the logits' device, without
    reading anything back to the host (so a pipelined decode can launch step N+1 from step
    N's tokens).

    - Rows that all carry small allowed-token sets (an audio codebook in a large text vocab)
      are compacted first: every later pass runs over the allowed ids only.
    - Repetition penalty reads a per-sequence [V] mask of seen ids kept on the device
      (``track`` a sequence with its prompt; each sampled token is added on the device).
    - A draw is inverse-CDF sampling with one uniform per row: ``seeded_uniform(seed,
      counter)`` for a seeded row (``counter`` = the output's index), else the sampler's own
      random stream. Same seed, same prompt, same outputs, whatever shares the batch.
    """

    def __init__(self, seed: int | None = None, fused: bool | None = None) -> None:
        """``fused``: batches whose rows all draw from small allowed sets, and batches over the
        full vocabulary without top-k / top-p, run as Triton kernels (``sample_triton``); None
        (auto) = on CUDA when triton imports."""
        self._fused = fused
        self._ranges = _RangeTable()
        self._rng = random.Random(seed)
        self._slots: dict[str, int] = {}  # tracked sequence -> row of _seen
        self._free: list[int] = []
        # [rows, V] bool; row 0: never seen (what untracked rows read), row 1: scratch (where
        # untracked rows' draws are written, so one scatter covers the batch without a sync)
        self._seen: torch.Tensor | None = None

    # -- repetition-penalty tracking ------------------------------------------------------
    def track(self, key: str, token_ids: Sequence[int], vocab: int, device: torch.device) -> None:
        """Start the seen-ids mask of sequence ``key`` from ``token_ids`` (its prompt)."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = self._free.pop() if self._free else self._grow(vocab, device)
        assert self._seen is not None
        self._seen[slot].zero_()  # queued after any in-flight write of a former owner
        if len(token_ids):
            self._seen[slot].index_fill_(0, h2d(torch.as_tensor(list(token_ids), dtype=torch.int64), device), True)

    def forget(self, key: str) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def _grow(self, vocab: int, device: torch.device) -> int:
        old = self._seen
        rows = 2 if old is None else old.shape[0]
        new = torch.zeros((2 * rows, vocab), dtype=torch.bool, device=device)
        if old is not None:
            new[:rows] = old
        self._seen = new
        self._free.extend(range(new.shape[0] - 1, rows, -1))
        return rows

    # -- sampling ------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 keys: Sequence[str | None] | None = None, counters: Sequence[int] | None = None,
                 columns: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, V] -> token ids [B] (int64, on logits' device). ``keys`` name tracked
        sequences (repetition penalty); ``counters`` are the rows' output indices (seeds).
        ``columns``: the logits cover only these sorted token ids (a restricted head); every
        row must then carry allowed ranges inside them. Every per-row number goes to the
        device in one upload (``plan`` then ``sample``, which an engine calls apart to upload
        the numbers before the logits exist)."""
        plan = self.plan(params, logits.shape[1], logits.device, keys, counters, columns)
        return self.sample(logits, plan, h2d(torch.from_numpy(plan.host), logits.device))

    def plan(self, params: Sequence[SamplingParams], vocab: int, device: torch.device,
             keys: Sequence[str | None] | None = None, counters: Sequence[int] | None = None,
             columns: torch.Tensor | None = None) -> SamplePlan:
        """The host half of a call for len(params) rows of logits ``vocab`` wide on ``device``
        (arguments as ``__call__``): which path samples and every per-row number
        (``SamplePlan.host``), which ``sample`` reads from the device."""
        n = len(params)
        if n == 0:
            return SamplePlan(np.zeros((3, 0)), vocab, "torch", (), compacts=False, penalize=False, greedy=True,
                              sorts=False, min_p=False, any_greedy=False, columns=columns)
        keys = keys or [None] * n
        counters = counters or [0] * n
        ranges = [p.allowed_token_ranges for p in params]
        constrained = all(ranges)
        if columns is not None and not constrained:
            raise ValueError("restricted logits (columns) need allowed-token ranges on every row")
        slots = [self._slots.get(k, 0) if k is not None and p.repetition_penalty != 1 else 0
                 for k, p in zip(keys, params, strict=True)]
        penalize = any(slots)
        set_ids = self._ranges.ids(ranges, device) if constrained else None
        table = self._ranges.table
        compacts = constrained and table is not None and (columns is not None or 2 * table.shape[1] <= vocab)
        fused = compacts and table.shape[1] <= FUSED_MAX_WIDTH and self._use_fused(device)
        # no allowed sets, no top-k / top-p anywhere: the full-vocabulary kernels
        sorts = any(p.top_k or p.top_p < 1 for p in params)
        full = columns is None and not any(ranges) and not sorts and self._use_fused(device)
        greedy = all(p.greedy for p in params) and not (fused or full)
        # rows: set id, seen-mask slot, penalty, then (sampling) temperature, top_p, min_p, top_k, greedy, uniform
        host = np.zeros((9 if not greedy else 3, n), dtype=np.float64)
        if constrained:
            host[0] = set_ids
        if penalize:
            host[1] = slots
            host[2] = [p.repetition_penalty for p in params]
        if not greedy:
            host[3:8] = np.array([p.draw_row for p in params]).T
            host[8] = self._uniforms(params, counters)
        path = "full" if full else "fused" if fused else "torch"
        return SamplePlan(host, vocab, path, tuple(ranges), compacts, penalize, greedy, sorts,
                          any(p.min_p > 0 for p in params), any(p.greedy for p in params), columns)

    def sample(self, logits: torch.Tensor, plan: SamplePlan, per_row: torch.Tensor) -> torch.Tensor:
        """The device half: token ids [B] from ``logits`` [B, plan.vocab] and ``per_row``, the
        plan's ``host`` on the logits' device."""
        n, vocab = logits.shape
        dev = logits.device
        if (n, vocab) != (plan.host.shape[1], plan.vocab) or tuple(per_row.shape) != plan.host.shape:
            raise ValueError(f"logits {tuple(logits.shape)} / per-row numbers {tuple(per_row.shape)} do not match the "
                             f"plan ({plan.host.shape[1]} rows, {plan.vocab} wide, {plan.host.shape})")
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=dev)
        columns, table = plan.columns, self._ranges.table
        if plan.path == "full":
            from mstar.services.engines.sample_triton import sample_full

            return sample_full(logits, per_row, self._seen if plan.penalize else None)
        if plan.path == "fused":
            from mstar.services.engines.sample_triton import sample_compact

            assert table is not None
            cols = self._ranges.positions(columns) if columns is not None else None
            return sample_compact(logits, table, cols, per_row, self._seen if plan.penalize else None)
        compact = cols = None
        if plan.constrained:
            assert table is not None
            if plan.compacts:
                set_idx = per_row[0].long()
                compact = table[set_idx]  # [B, L] token ids, -1 = padding
                cols = compact if columns is None else self._ranges.positions(columns)[set_idx]
        if compact is not None:
            x = logits.gather(1, cols.clamp(min=0)).float().masked_fill_(compact < 0, float("-inf"))
        else:
            x = logits.clone() if logits.dtype == torch.float32 else logits.float()  # masks write in place
            apply_allowed_ranges(x, plan.ranges)
        if plan.penalize:
            assert self._seen is not None
            slot = per_row[1].long()
            seen = self._seen[slot] if compact is None else self._seen[slot[:, None], compact.clamp(min=0)]
            apply_repetition_penalty(x, seen, per_row[2])
        if plan.greedy:
            pick = x.argmax(-1)
        else:
            pick = self._draw(x, per_row[3:], sort=plan.sorts, min_p=plan.min_p, any_greedy=plan.any_greedy)
        tokens = pick if compact is None else compact.gather(1, pick[:, None])[:, 0]
        if plan.penalize:  # mark the drawn ids seen; untracked rows write into the scratch row 1
            self._seen.view(-1).index_fill_(0, torch.where(slot > 0, slot, 1) * self._seen.shape[1] + tokens, True)
        return tokens

    def _use_fused(self, device: torch.device) -> bool:
        if self._fused is None:
            from mstar.services.engines.cuda_graphs import triton_unavailable_reason

            self._fused = device.type == "cuda" and triton_unavailable_reason() is None
        return self._fused

    def _uniforms(self, params: Sequence[SamplingParams], counters: Sequence[int]) -> np.ndarray:
        if all(p.seed is not None for p in params):
            return seeded_uniforms([p.seed for p in params], counters)
        return np.array([seeded_uniform(p.seed, c) if p.seed is not None else self._rng.random()
                         for p, c in zip(params, counters, strict=True)])

    @staticmethod
    def _draw(x: torch.Tensor, rows: torch.Tensor, sort: bool, min_p: bool, any_greedy: bool) -> torch.Tensor:
        """Temperature, top-k / top-p / min-p, then inverse-CDF draws; greedy rows argmax.
        ``rows`` [6, B]: temperature, top_p, min_p, top_k, greedy, uniform (float64); ``sort``
        when a row uses top-k / top-p, ``min_p`` when one uses min-p, ``any_greedy`` when a
        row is greedy."""
        temp, top_p, min_ps, top_k, greedy, u = rows.unbind(0)
        greedy_pick = x.argmax(-1) if any_greedy else None
        probs, order = filtered_probs(x / temp.float()[:, None], top_k, top_p.float(), min_ps.float() if min_p else None,
                                      sort)
        if order is not None:  # the draw runs in vocabulary order whatever decided the kept set
            probs = torch.empty_like(probs).scatter_(1, order, probs)
        cdf = row_cumsum(probs, torch.float64, padded=True)  # runs past V with the total
        target = (u * cdf[:, -1])[:, None]
        pick = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=x.shape[-1] - 1)
        return pick if greedy_pick is None else torch.where(greedy.bool(), greedy_pick, pick)
