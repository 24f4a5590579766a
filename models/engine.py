"""The engine contract: what a node group's ``EngineDriver`` calls on an engine node's engine.

An ``EngineNode`` (base.py) says what a call asks of its engine (``prepare`` -> work) and what an
output means for the call (``outputs``); its ``engine`` does the work, batched across requests, on
its own schedule. The driver (services/node_group/engine_driver.py) calls, on the engine's thread,
``release`` for the requests that ended, ``submit`` for the new work, then ``step`` while
``has_work``; on the event loop it reads ``has_work``; through the node, the service calls
``close`` when stopping and ``exit_reason`` to learn that the engine can no longer step.

Engines: ``LocalSeqEngine`` and ``EngineProcess`` (a ``KVCacheEngine`` in this process or in a
child; services/engines/), Qwen3-Omni's ``ThinkerEngine`` and ``TalkerEngine``. Each subclasses
``Engine`` so that the type checker holds its signatures to this one; an engine that does not
(a test's fake) is held to it when a node sets it (``check_engine``), not at its first call.

Optional, looked up by name: ``kv_stats() -> KvStats`` (exported as ``mstar_kv_*``; an engine
without a KV cache has none) and ``follow()`` (tensor-parallel ranks past 0 mirror rank 0).
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, cast

WorkT = TypeVar("WorkT", contravariant=True)


class EngineOutput(Protocol):
    """One step's output for one request, as the driver reads it (``SeqOutput``, ``OmniOut``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def token_id(self) -> int | None:
        """None: the sequence was aborted or its work refused; ``error`` says why."""

    @property
    def kv(self) -> Any:
        """With a hand-off sequence's last output: the K/V it hands over (its pages are freed)."""

    @property
    def error(self) -> str | None: ...

    @property
    def finished(self) -> bool:
        """The sequence ended with this output (no more follow)."""


class Engine(Protocol[WorkT]):
    """A sequence engine: one sequence per request at most, fed typed work (``WorkT``: what its
    node's ``prepare`` returns), stepped by one thread at a time."""

    @property
    @abstractmethod
    def has_work(self) -> bool:
        """Whether ``step`` has anything to do (sequences running or waiting, answers owed)."""

    @abstractmethod
    def submit(self, request_id: str, work: WorkT, /) -> None:
        """Queue ``work`` for the request's sequence. Work the engine cannot take is answered by a
        later step (an output with ``token_id`` None and the reason), never raised here."""

    @abstractmethod
    def release(self, request_id: str, /) -> None:
        """The request ended: free whatever the engine holds of it (no output of it follows)."""

    @abstractmethod
    def step(self) -> Sequence[EngineOutput]:
        """One step: at most one output per request. ``StepFailed`` (kv_engine.py) naming requests
        fails those alone (the engine released them); any other exception fails every waiting call."""

    @abstractmethod
    def close(self) -> None:
        """The service is stopping (after the last step)."""

    @abstractmethod
    def exit_reason(self) -> str | None:
        """Why the engine can no longer step (its process died), else None."""


#: the members an engine must have (the protocol's abstract ones), in the order a missing one is named
ENGINE_MEMBERS: tuple[str, ...] = tuple(sorted(Engine.__abstractmethods__))


def check_engine(engine: object, node: str) -> Engine[Any]:
    """``engine`` if it has every member of ``Engine``, else TypeError naming what it lacks (at the
    node's construction, not at the first call that needs it). ``node``: who holds it, for the message."""
    if engine is None:
        raise TypeError(f"{node} has no engine: an EngineNode sets self.engine (an mstar.models.engine.Engine) "
                        f"when it is made")
    missing = []
    for name in ENGINE_MEMBERS:  # looked up without calling has_work (a property that may take a lock)
        member = inspect.getattr_static(engine, name, None)
        if member is None or getattr(member, "__isabstractmethod__", False):
            missing.append(name)
        elif name != "has_work" and not callable(getattr(engine, name)):
            missing.append(name)
    if missing:
        raise TypeError(f"{node}: its engine {type(engine).__name__} lacks {', '.join(missing)} of the engine "
                        f"contract (mstar.models.engine.Engine: {', '.join(ENGINE_MEMBERS)})")
    return cast("Engine[Any]", engine)  # checked above, member by member
