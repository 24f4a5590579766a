"""The KV-cache engine under the engine contract (``mstar.models.engine.Engine``): sequences in,
per-request outputs out.

A request owns at most one generating sequence in an engine. Work for it is typed:
``StartSeq`` (a prompt) or ``ImportSeq`` (a sequence whose first tokens' K/V were computed
by another engine: the KV hand-off between node groups). Each step returns ``SeqOutput``s:
a sampled token, or an abort with the reason. A sequence started with ``handoff`` ends
after its first token, and that output carries the K/V of its prompt (``kv``); its pages are
freed at once.

``LocalSeqEngine`` puts a ``KVCacheEngine`` behind this surface on the thread that calls it;
``EngineProcess`` (engine_process.py) does the same from a child process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from mstar.metrics import KvStats
from mstar.models.engine import Engine
from mstar.services.engines.kv_engine import KVCacheEngine
from mstar.services.engines.sampling import SamplingParams
from mstar.services.engines.sequence import SeqStatus

__all__ = ["ImportSeq", "KvStats", "LocalSeqEngine", "SeqOutput", "SeqWork", "StartSeq"]


@dataclass(frozen=True)
class StartSeq:
    """Start the request's sequence on ``prompt_ids``."""

    prompt_ids: Sequence[int]
    params: SamplingParams
    key: tuple[str, str] = ("", "")  # (node, walk): the scheduler's fairness class
    handoff: bool = False  # end after the first token; that output carries the prompt's K/V


@dataclass(frozen=True)
class ImportSeq:
    """Continue a sequence another engine started: ``kv`` [layers, 2, n, kv_heads, head_dim]
    holds the K/V of ``token_ids[:n]``; the next output sampled is number ``num_output_tokens``."""

    token_ids: Sequence[int]
    kv: torch.Tensor
    params: SamplingParams
    num_output_tokens: int
    key: tuple[str, str] = ("", "")
    handoff: bool = False


SeqWork = StartSeq | ImportSeq


class SeqOutput(NamedTuple):
    """One step's output for one request (a tuple: made, pickled and read per token)."""

    request_id: str
    token_id: int | None  # None: the sequence was aborted or refused; see ``error``
    status: SeqStatus
    kv: torch.Tensor | None = None  # a hand-off sequence's prompt K/V, with its last output
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.status > SeqStatus.PREEMPTED


class LocalSeqEngine(Engine[SeqWork]):
    """A ``KVCacheEngine`` driven in this process; not thread-safe (one thread calls it)."""

    def __init__(self, engine: KVCacheEngine):
        self.engine = engine
        self._handoff: set[str] = set()
        self._refused: list[SeqOutput] = []  # work the engine raised on: reported with the next step

    def submit(self, request_id: str, work: SeqWork) -> None:
        params = replace(work.params, max_tokens=1) if work.handoff else work.params
        try:
            if isinstance(work, StartSeq):
                self.engine.add_request(request_id, work.prompt_ids, params, key=work.key)
            else:
                self.engine.import_request(request_id, work.token_ids, work.kv, params, key=work.key,
                                           num_output_tokens=work.num_output_tokens)
        except Exception as e:
            # the id ends here, whatever it already held (a duplicate id's first sequence too):
            # no output of it follows the refusal, and none of its pages stay taken
            self.release(request_id)
            self._refused.append(SeqOutput(request_id, None, SeqStatus.FINISHED_ABORTED,
                                           error=f"refused by the KV-cache engine: {type(e).__name__}: {e}"))
            return
        if work.handoff:
            self._handoff.add(request_id)

    def release(self, request_id: str) -> None:
        self._handoff.discard(request_id)
        self.engine.release(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._refused) or self.engine.has_work

    def step(self) -> list[SeqOutput]:
        """The outputs of one engine step (raises ``StepFailed`` as the engine does)."""
        out, self._refused = self._refused, []
        if not self.engine.has_work:
            return out
        for ev in self.engine.step():
            rid, kv = ev.request_id, None
            if ev.token_id is None:
                self._handoff.discard(rid)
                out.append(SeqOutput(rid, None, ev.status, error="aborted by the KV-cache engine (its timeout)"))
                continue
            if ev.status.finished and rid in self._handoff:
                kv = self.engine.export_kv(rid)
                self.release(rid)  # the K/V left with this output: nothing stays here
            out.append(SeqOutput(rid, ev.token_id, ev.status, kv))
        return out

    def kv_stats(self) -> KvStats:
        alloc = self.engine.cache.allocator
        return KvStats(alloc.num_used, alloc.num_free, self.engine.stats.preemptions)

    def follow(self) -> None:
        self.engine.follow()

    def close(self) -> None:
        self.engine.close()

    def exit_reason(self) -> str | None:
        return None
