"""A generating sequence as the scheduler sees it: token counts and a lifecycle status."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from mstar.services.engines.sampling import FinishReason, SamplingParams, check_stop


class SeqStatus(IntEnum):
    """Ordered: ``status > PREEMPTED`` means finished; ``status < RUNNING`` means queued."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # pages taken back; queued again, recomputes from token 0
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5  # released, cancelled, timed out or failed

    @property
    def finished(self) -> bool:
        return self > SeqStatus.PREEMPTED


FINISH_STATUS = {FinishReason.STOP: SeqStatus.FINISHED_STOPPED, FinishReason.LENGTH: SeqStatus.FINISHED_LENGTH}


@dataclass(eq=False)
class Sequence:
    """Tokens ``[0, num_computed_tokens)`` have K/V in the cache; the rest are still to run.

    Prefill, chunked prefill, decode and recompute after preemption are all the same thing:
    ``num_computed_tokens`` catching up to ``num_tokens``; when it does, a token is sampled.
    A sequence handed over from another engine (``resumed``) is the same thing again: it
    starts with some tokens computed and some outputs already sampled.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    key: tuple[str, str] = ("", "")  # (node, walk): the fairness class
    label: str = "main"  # which of the request's caches this sequence fills
    arrival: int = 0  # admission order; the newest running sequence is preempted first
    deadline: float | None = None  # clock time after which the engine aborts it
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        self.num_prompt_tokens = len(self.token_ids)

    @classmethod
    def resumed(cls, request_id: str, token_ids: list[int], params: SamplingParams, num_output_tokens: int,
                num_computed_tokens: int, key: tuple[str, str] = ("", ""), deadline: float | None = None) -> Sequence:
        """A sequence carried over from another engine: the last ``num_output_tokens`` of
        ``token_ids`` were sampled there, and the first ``num_computed_tokens`` have K/V here
        already. At least the last token is left to compute (the next output needs its logits)."""
        n = len(token_ids)
        if not 0 <= num_output_tokens < n:
            raise ValueError(f"request {request_id}: num_output_tokens={num_output_tokens} must be in [0, {n}) "
                             f"for {n} token_ids (the prompt cannot be empty)")
        if not 0 <= num_computed_tokens < n:
            raise ValueError(f"request {request_id}: K/V of {num_computed_tokens} tokens for {n} token_ids; send "
                             f"at most {n - 1} (the last token's K/V is computed where the next token is sampled)")
        if num_output_tokens and check_stop(params, token_ids[-1], num_output_tokens) is not None:
            raise ValueError(f"request {request_id}: already finished after {num_output_tokens} outputs "
                             f"(max_tokens={params.max_tokens}, stop_token_ids={params.stop_token_ids}); nothing to continue")
        seq = cls(request_id, list(token_ids), params, key, deadline=deadline, num_computed_tokens=num_computed_tokens)
        seq.num_prompt_tokens = n - num_output_tokens
        return seq

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens
