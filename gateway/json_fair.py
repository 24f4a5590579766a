"""Turns for large bodies: one caller cannot hold all the JSON workers (json_pool.py).

A caller is its API key (its key id, auth.py), or without keys its client address. A caller has
at most one large body in progress at a time, from the read of its bytes past the inline size to
the end of its parse; its next ones wait their turn in order, their bodies left unread on the
socket (so waiting costs no memory), at most ``MAX_WAITING_BODIES`` of them and at most the
gateway's request timeout each. Past either: 429 RESOURCE_EXHAUSTED with ``Retry-After``.
Queueing rather than refusing at once keeps a client that sends a few image requests at a time
working, and a flood from one key waits on itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from mstar.gateway.errors import ApiError
from mstar.limits import MAX_WAITING_BODIES

RETRY_AFTER_S = 1


@dataclass
class _Line:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: bodies in progress or waiting
    count: int = 0


class Turns:
    def __init__(self, max_waiting: int = MAX_WAITING_BODIES):
        self.max_waiting = max_waiting
        self._lines: dict[str, _Line] = {}

    def in_line(self, caller: str) -> int:
        line = self._lines.get(caller)
        return line.count if line else 0

    async def take(self, caller: str, wait_s: float) -> Callable[[], None]:
        """Wait for ``caller``'s turn; the returned function ends it (call it exactly once)."""
        line = self._lines.setdefault(caller, _Line())
        if line.count > self.max_waiting:
            raise _busy(f"this caller already has a large body being read or parsed and {self.max_waiting} "
                        "waiting; send it again later")
        line.count += 1
        try:
            await asyncio.wait_for(line.lock.acquire(), wait_s)
        except BaseException as e:
            self._leave(caller, line)
            if isinstance(e, TimeoutError):
                raise _busy(f"this caller's earlier large bodies held the JSON workers for {wait_s:g} s; "
                            "send it again later") from None
            raise
        done = False

        def end() -> None:
            nonlocal done
            if not done:
                done = True
                line.lock.release()
                self._leave(caller, line)

        return end

    def _leave(self, caller: str, line: _Line) -> None:
        line.count -= 1
        if line.count == 0:
            del self._lines[caller]


def _busy(message: str) -> ApiError:
    return ApiError(429, message, code="RESOURCE_EXHAUSTED", headers={"Retry-After": str(RETRY_AFTER_S)})
