"""One engine-backed node's driver: everything between the runtime and the node's engine.

The runtime hands the driver each ready call of the node (``submit``) and polls it every
round (``poll``). The driver keeps, on the event loop's thread alone:
- the work for the engine (sequences to start or import) and the requests to release, both
  handed to the engine's thread with its next step;
- the step in flight (a future on the engine's thread; the engine steps back to back while
  the event loop routes the previous step's outputs);
- per request, the call waiting for the sequence's next output, and outputs that came
  before their call (the engine decodes every running sequence each step, whenever the
  graph's loop asks for the next token).
The outputs of calls that were waiting when a step was launched are made on the engine's
thread right after the step (``EngineNode.outputs``), while the event loop is in gRPC with
the GIL free; the rest on the event loop.
It answers with typed results: ``Ready`` (outputs now), ``TAKEN`` (a later step answers) or
``DEFERRED`` (the work goes to the engine with its next step; a later step answers).
What it calls on the engine is the engine contract, ``mstar.models.engine.Engine``: an engine
lacking part of it is refused when the driver is made (``check_engine``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from mstar import nvtx
from mstar.models.base import EngineNode, NodeCall
from mstar.models.engine import Engine, EngineOutput, check_engine
from mstar.services.engines.kv_engine import StepFailed
from mstar.services.engines.seq_engine import SeqOutput
from mstar.services.engines.sequence import SeqStatus

log = logging.getLogger(__name__)


class Submitted(enum.Enum):
    TAKEN = "taken"  # the call waits for its sequence's next output
    DEFERRED = "deferred"  # the call's work goes to the engine with its next step


@dataclass(slots=True)
class Ready:
    """The call's outputs (or why it failed), now."""

    outputs: dict | Exception


Completion = tuple[NodeCall, Any, dict | Exception]  # (call, the runtime's `where`, outputs or error)


class EngineDriver:
    def __init__(self, node: str, sub: EngineNode, executor: Executor, wake: Callable[[], None]):
        self.node, self.sub = node, sub
        self.engine: Engine[Any] = check_engine(sub.engine, f"engine node '{node}'")
        self._executor, self._wake = executor, wake
        self._work: list[tuple[str, Any]] = []  # (request, what its node's prepare returned)
        self._releases: list[str] = []
        self._step: asyncio.Future | None = None
        self._waiting: dict[str, tuple[NodeCall, Any]] = {}  # request -> its call waiting for the next output
        self._early: dict[str, deque[EngineOutput]] = {}  # outputs that came before their call
        self._live: set[str] = set()  # requests whose sequence has not finished (outputs still to come)
        self._held: set[str] = set()  # requests the engine may hold pages of (released with the request)
        self.steps = 0
        self.last_step_s = 0.0
        self._gather_since: float | None = None  # when a step began to wait for more calls (``gather_s``)
        self._gather_timer_pending = False  # a gather wake-up is scheduled and has not fired

    # -- calls in ----------------------------------------------------------------------------
    def submit(self, call: NodeCall, where: Any) -> Ready | Submitted:
        rid = call.request_id
        if rid in self._waiting:
            return Ready(RuntimeError(f"engine node '{self.node}': request {rid} already has a call waiting for "
                                      f"its sequence's next output; a request's calls of one engine node run in turn"))
        try:
            work = self.sub.prepare(call)
        except Exception as e:
            return Ready(e)
        if work is not None:
            self._work.append((rid, work))
            self._live.add(rid)
            self._held.add(rid)
            self._waiting[rid] = (call, where)
            return Submitted.DEFERRED
        early = self._early.get(rid)
        if early:
            out = early.popleft()
            if not early:
                del self._early[rid]
            return Ready(self._outputs(call, out))
        if rid not in self._live:
            return Ready(self._outputs(call, None))
        self._waiting[rid] = (call, where)
        return Submitted.TAKEN

    def release(self, request_id: str) -> None:
        """The request ended: nothing of it is answered any more; its pages go with the next step."""
        self._waiting.pop(request_id, None)
        self._early.pop(request_id, None)
        self._live.discard(request_id)
        if request_id in self._held:
            self._held.discard(request_id)
            self._work = [(r, w) for r, w in self._work if r != request_id]
            self._releases.append(request_id)
            self._wake()

    # -- steps -------------------------------------------------------------------------------
    @property
    def step_done(self) -> bool:
        return self._step is not None and self._step.done()

    def poll(self, loop: asyncio.AbstractEventLoop) -> list[Completion] | None:
        """Launch the next step (if there is work) once none runs; return what the step that
        finished answered, or None if none finished since the last poll."""
        fut = self._step
        if fut is not None and not fut.done():
            return None
        self._step = None
        if fut is None:
            self._launch(loop, ())
            return None
        try:
            outs, made, t0 = fut.result()
        except StepFailed as e:
            log.error("engine of node '%s' failed a step (requests %s)", self.node, e.request_ids, exc_info=e)
            done = self._fail(e.request_ids, e.__cause__ or e)
            self._launch(loop, ())
            return done
        except Exception as e:
            log.exception("engine of node '%s' failed a step", self.node)
            done = self._fail(list(self._waiting), e)
            self._launch(loop, ())
            return done
        self.steps += 1
        self.last_step_s = time.perf_counter() - t0
        # the next step runs while this one's outputs are routed: the calls they answer do not
        # wait for it (unless it gathers them: ``gather_s``)
        going = {o.request_id for o in outs if not (o.finished or o.token_id is None)}
        self._launch(loop, {o.request_id for o in outs}, going)
        return self._route(outs, made)

    def _launch(self, loop: asyncio.AbstractEventLoop, answered, going=frozenset()) -> None:
        """``going``: sequences the step that just ended answered and that go on (their next
        calls come once the outputs are routed)."""
        if not (self._work or self._releases or self.engine.has_work):
            return
        if self._gather(loop, going):
            return
        waiting = {rid: call for rid, (call, _) in self._waiting.items() if rid not in answered}
        args = (self.engine, self._work, self._releases, time.perf_counter(), self.sub.outputs, waiting, self.node)
        self._work, self._releases = [], []
        if self.sub.blocking:
            fut = loop.run_in_executor(self._executor, _engine_step, *args)
        else:
            fut = loop.create_future()
            try:
                fut.set_result(_engine_step(*args))
            except Exception as e:
                fut.set_exception(e)
        fut.add_done_callback(lambda _f: self._wake())
        self._step = fut

    def _gather(self, loop: asyncio.AbstractEventLoop, going) -> bool:
        """Whether the step waits (``EngineNode.gather_s``) for the next calls of running
        sequences: those just answered, or whose call has not come since. It waits at most
        ``gather_s`` from when it began to, then steps with what came (a sequence whose loop
        waits on its own input, as the Talker's for the Thinker's next row, costs a step that long)."""
        wait = self.sub.gather_s
        coming = (self._live - self._waiting.keys()) | (going & self._live)
        if not wait or not self._work or self._releases or not coming:
            self._gather_since = None
            return False
        now = time.perf_counter()
        if self._gather_since is None:
            self._gather_since = now
        left = self._gather_since + wait - now
        if left <= 0:
            self._gather_since = None
            return False
        if not self._gather_timer_pending:  # one at a time; once it fires, the next check makes another
            self._gather_timer_pending = True
            # at least 1 ms: uvloop runs a shorter delay as call_soon, before the wait is over
            loop.call_later(max(left, 0.001), self._gather_timer_fired)
        return True

    def _gather_timer_fired(self) -> None:
        self._gather_timer_pending = False
        self._wake()

    def _route(self, outs: Sequence[EngineOutput], made: dict[str, tuple[NodeCall, dict | Exception]]) -> list[Completion]:
        done: list[Completion] = []
        for out in outs:
            rid = out.request_id
            if rid not in self._live:
                continue  # released meanwhile
            if out.finished or out.token_id is None:
                self._live.discard(rid)
                if out.kv is not None:
                    self._held.discard(rid)  # handed off: the engine freed its pages
            waiting = self._waiting.pop(rid, None)
            if waiting is None:
                self._early.setdefault(rid, deque()).append(out)
                continue
            pre = made.pop(rid, None)  # made on the engine's thread for this very call
            result = pre[1] if pre is not None and pre[0] is waiting[0] else self._outputs(waiting[0], out)
            done.append((waiting[0], waiting[1], result))
        return done

    def _fail(self, request_ids, error: BaseException) -> list[Completion]:
        done: list[Completion] = []
        for rid in request_ids:
            self._live.discard(rid)
            self._held.discard(rid)  # the engine released them
            waiting = self._waiting.pop(rid, None)
            if waiting is not None:
                done.append((waiting[0], waiting[1], RuntimeError(f"engine step failed: {type(error).__name__}: {error}")))
            else:
                self._early.setdefault(rid, deque()).append(
                    SeqOutput(rid, None, SeqStatus.FINISHED_ABORTED, error=f"engine step failed: {type(error).__name__}: {error}"))
        return done

    def _outputs(self, call: NodeCall, out: EngineOutput | None) -> dict | Exception:
        if out is not None and out.token_id is None:
            return RuntimeError(f"request {call.request_id}: {out.error}")
        try:
            return self.sub.outputs(call, out)
        except Exception as e:
            return e

    def close(self) -> None:
        self.sub.close()


def _engine_step(engine: Engine[Any], work: list[tuple[str, Any]], releases: list[str], t0: float, outputs,
                 waiting: dict[str, NodeCall], node: str):
    """One engine step on the engine's thread: releases, then new work, then the step; then the
    outputs of the calls that were waiting for it (each request's first output of the step)."""
    for rid in releases:
        engine.release(rid)
    for rid, w in work:
        engine.submit(rid, w)
    with nvtx.span(f"{node} engine step") if nvtx.ACTIVE else nvtx.NULL:
        outs = engine.step() if engine.has_work else []
    made: dict[str, tuple[NodeCall, dict | Exception]] = {}
    for out in outs:
        call = waiting.pop(out.request_id, None)
        if call is not None and out.token_id is not None:
            try:
                made[out.request_id] = (call, outputs(call, out))
            except Exception as e:
                made[out.request_id] = (call, e)
    return outs, made, t0
