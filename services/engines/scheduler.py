"""Micro-scheduler for one KV-cache engine: continuous batching with chunked prefill.

Every step: running sequences first (decode needs one token, an unfinished prefill its next
chunk), then waiting sequences admitted round-robin across (node, walk) keys, all under a
token budget. Pages are reserved here; when a running sequence cannot grow, the newest
running sequence is preempted (pages freed, recomputed later); a waiting sequence that does
not fit simply stays queued. A waiting sequence may hold K/V already (handed over from another
engine); when nothing runs, so that no page would ever come back, such K/V is dropped, newest
first, for the sequence at the head of the queue (recomputed later, like a preemption). A
sequence that finishes (stop token, max tokens) keeps its committed K/V for later passes of its
request until the request is released; an aborted one frees its pages at once. Pure Python: the cache is anything with the ``PageBudget`` calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from mstar.services.engines.sampling import check_stop
from mstar.services.engines.sequence import FINISH_STATUS, SeqStatus, Sequence


class PageBudget(Protocol):
    @property
    def num_free_pages(self) -> int: ...

    def pages_needed(self, request_id: str, label: str, num_tokens: int) -> int: ...

    def reserve(self, request_id: str, label: str, num_tokens: int) -> None: ...

    def truncate(self, request_id: str, label: str) -> None: ...

    def free_seq(self, request_id: str, label: str) -> None: ...


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences at once
    max_num_batched_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    max_pages_per_seq: int | None = None  # a sequence needing more is aborted, not queued forever

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("SchedulerConfig: max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position run this step (== num_computed_tokens at schedule time)
    num_tokens: int
    samples: bool  # reaches the sequence's last token (at schedule time): a token is sampled

    @classmethod
    def next_for(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Sequence, ...] = ()
    aborted: tuple[Sequence, ...] = ()  # can never fit in the cache

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_decode(self) -> bool:
        return bool(self.chunks) and all(c.num_tokens == 1 and c.samples for c in self.chunks)


@dataclass(frozen=True)
class SeqEvent:
    request_id: str
    token_id: int | None  # the sampled token, None for an abort
    status: SeqStatus


@dataclass
class Scheduler:
    cache: PageBudget
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    running: list[Sequence] = field(default_factory=list)  # admission order: newest last
    waiting: dict[tuple[str, str], deque[Sequence]] = field(default_factory=dict)
    _keys: deque[tuple[str, str]] = field(default_factory=deque)  # round-robin order
    _arrivals: int = 0

    # -- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        if seq.key not in self.waiting:
            self.waiting[seq.key] = deque()
            self._keys.append(seq.key)
        self.waiting[seq.key].append(seq)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def find(self, request_id: str) -> list[Sequence]:
        queued = [s for q in self.waiting.values() for s in q]
        return [s for s in self.running + queued if s.request_id == request_id]

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of the request, freeing its pages."""
        seqs = self.find(request_id)
        for s in seqs:
            self._finish(s, SeqStatus.FINISHED_ABORTED)
        return seqs

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while self._pages_short(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                self.cache.reserve(seq.request_id, seq.label, seq.num_computed_tokens + n)
                chunks.append(ScheduledChunk.next_for(seq, n))
                budget -= n
        aborted = [] if preempted else self._admit(chunks, budget, preempted)
        return SchedulerOutput(tuple(chunks), tuple(preempted), tuple(aborted))

    def update_from_output(self, out: SchedulerOutput, sampled: Seq[int | None]) -> list[SeqEvent]:
        """Advance counts; ``sampled[i]`` is the token drawn for ``out.chunks[i]`` (None when
        the chunk does not sample)."""
        events = [SeqEvent(s.request_id, None, s.status) for s in out.aborted]
        for chunk, token in zip(out.chunks, sampled, strict=True):
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:  # released while the step ran
                continue
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            if not chunk.samples:
                continue
            if token is None:
                raise ValueError(f"request {seq.request_id}: chunk samples but no token was given")
            seq.token_ids.append(token)
            reason = check_stop(seq.params, token, seq.num_output_tokens)
            if reason is not None:
                self._finish(seq, FINISH_STATUS[reason])
            events.append(SeqEvent(seq.request_id, token, seq.status))
        return events

    # -- named state changes ----------------------------------------------------------------
    def _admit(self, chunks: list[ScheduledChunk], budget: int, preempted: list[Sequence]) -> list[Sequence]:
        aborted: list[Sequence] = []
        tried = 0
        while budget > 0 and len(self.running) < self.config.max_num_seqs and tried < len(self._keys):
            key = self._keys[0]
            self._keys.rotate(-1)
            queue = self.waiting[key]
            if not queue:
                tried += 1
                continue
            tried = 0
            seq = queue[0]
            limit = self.config.max_pages_per_seq
            if limit is not None and self.cache.pages_needed(seq.request_id, seq.label, seq.num_tokens + 1) > limit:
                queue.popleft()
                self._finish(seq, SeqStatus.FINISHED_ABORTED)
                aborted.append(seq)
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if self._pages_short(seq, seq.num_computed_tokens + n) and not self._reclaim(seq, n, preempted):
                break  # stays queued; admitting later keys first would starve it
            queue.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.cache.reserve(seq.request_id, seq.label, seq.num_computed_tokens + n)
            chunks.append(ScheduledChunk.next_for(seq, n))
            budget -= n
        return aborted

    def _pages_short(self, seq: Sequence, num_tokens: int) -> bool:
        return self.cache.pages_needed(seq.request_id, seq.label, num_tokens) > self.cache.num_free_pages

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_kv(seq)
        self.waiting[seq.key].appendleft(seq)

    def _reclaim(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        """With nothing running, drop the K/V of other waiting sequences (newest first) until
        ``seq``'s next ``n`` tokens fit; False when they still do not."""
        if self.running:
            return False
        holders = [s for q in self.waiting.values() for s in q if s is not seq and s.num_computed_tokens]
        for victim in sorted(holders, key=lambda s: s.arrival, reverse=True):
            if not self._pages_short(seq, seq.num_computed_tokens + n):
                break
            self._drop_kv(victim)  # keeps its place in the queue
            preempted.append(victim)
        return not self._pages_short(seq, seq.num_computed_tokens + n)

    def _drop_kv(self, seq: Sequence) -> None:
        self.cache.free_seq(seq.request_id, seq.label)
        seq.status = SeqStatus.PREEMPTED
        seq.num_computed_tokens = 0

    def _finish(self, seq: Sequence, status: SeqStatus) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq.key in self.waiting and seq in self.waiting[seq.key]:
            self.waiting[seq.key].remove(seq)
        if status is SeqStatus.FINISHED_ABORTED:
            self.cache.free_seq(seq.request_id, seq.label)
        else:
            self.cache.truncate(seq.request_id, seq.label)  # drop capacity reserved past the committed K/V
        seq.status = status
