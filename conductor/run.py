"""One admitted request of the Conductor API, from its registration to its release.

``ConductorServicer._run`` reads and admits a request (the steps that refuse it before anything
is held); a ``RequestRun`` then owns it: registered under the caller's id, its deadline armed,
its first walk started, its outputs streamed as GenerateResponse messages, the final message
(usage, timings) and, on every path (success, failure, timeout, cancel, client gone), its release.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from mstar import auth, metrics, nvtx
from mstar.conductor.convert import fill_chunk
from mstar.conductor.requests import ActiveRequest, Failure, Finished, RequestTable
from mstar.models.graph import Modality
from mstar.v1 import conductor_pb2 as cpb

_MODALITY_NAMES = {m: m.name.lower() for m in Modality}  # metric labels (Enum.name is a slow property)


class RequestRun:
    def __init__(self, table: RequestTable, request_metrics: metrics.RequestMetrics,
                 by_client_id: dict[tuple[str, str], ActiveRequest], key_limits: auth.KeyLimiter,
                 kid: str, rid: str, ar: ActiveRequest, timeout_s: float, process_s: float):
        """``ar`` of key ``kid`` (its slot in ``key_limits`` taken), known to the client as ``rid``
        (``by_client_id``), pinned; ``timeout_s`` counts from ``ar.t0``, reading it took ``process_s``."""
        self.table, self.metrics, self.by_client_id, self.key_limits = table, request_metrics, by_client_id, key_limits
        self.kid, self.rid, self.ar = kid, rid, ar
        self.timeout_s, self.process_s = timeout_s, process_s
        self.counts: dict[str, int] = {}  # outputs so far, by name (each chunk's index)
        self.clock = metrics.OutputClock(ar.t0)
        self.outcome: str | None = None  # a Failure's code, OK, or (None at the end) CANCELLED: the client went away
        self._deadline: asyncio.TimerHandle | None = None

    async def responses(self, context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.GenerateResponse]:
        """The request's messages, each with every output queued while the last was in flight; the
        last one carries the final event. A Failure aborts ``context`` with its status."""
        self._register()
        try:  # from here on every path releases the request (finally)
            self._arm_deadline()
            self._first_walk()
            while True:
                resp, end = await self._next_message()
                if isinstance(end, Failure):
                    self.outcome = end.code.name
                    if resp.chunks:
                        yield resp
                    await context.abort(end.code, end.message)
                if isinstance(end, Finished):
                    break
                yield resp
            yield self._final(resp)
        except Exception:
            if self.outcome is None:  # not a Failure event (whose abort raises): a bug here or in the model's state machine
                self.outcome = "UNKNOWN"
            raise
        finally:  # success, failure, timeout, cancel or client gone: everything is released
            self._release()

    def _register(self) -> None:
        self.table.active[self.ar.request_id] = self.ar
        self.by_client_id[self.kid, self.rid] = self.ar
        self.metrics.started.inc()

    def _arm_deadline(self) -> None:
        """One timer for the whole request (not a wait_for task per event): at the deadline the
        request fails, which queues the Failure event the stream ends on."""
        timeout = self.timeout_s
        self._deadline = asyncio.get_running_loop().call_later(
            max(timeout - (time.perf_counter() - self.ar.t0), 0), self.table.fail, self.ar,
            grpc.StatusCode.DEADLINE_EXCEEDED, f"request exceeded its timeout of {timeout:g} s")

    def _first_walk(self) -> None:
        try:
            with nvtx.span("conductor: first walk"):
                seed = self.table.model.next_walk(self.ar.state, None)
                self.table.start_walk(self.ar, seed)  # type: ignore[arg-type]  # None: a bug, failed below
        except Exception as e:  # a bug in the state machine (None included): fails this request like any later one
            self.table.model_failed(self.ar, e)

    async def _next_message(self) -> tuple[cpb.GenerateResponse, Failure | Finished | None]:
        """The next event and every one queued behind it as one message, up to the request's end
        (a Failure or Finished, returned beside the message)."""
        ar, counts = self.ar, self.counts
        event = await ar.events.get()
        resp = cpb.GenerateResponse(request_id=self.rid)
        chunks = resp.chunks
        while True:
            if isinstance(event, Failure | Finished):
                return resp, event
            index = counts.get(event.name, 0)
            counts[event.name] = index + 1
            now = time.perf_counter()
            self.clock.tick(self.metrics, _MODALITY_NAMES[event.modality], now)
            fill_chunk(chunks.add(), event, index, now - ar.t0)
            if ar.events.empty():
                return resp, None
            event = ar.events.get_nowait()

    def _final(self, resp: cpb.GenerateResponse) -> cpb.GenerateResponse:
        """``resp`` (the message the request finished in) with the final event: usage, timings."""
        ar, state = self.ar, self.ar.state
        usage = cpb.Usage(prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens,
                          walks=ar.walks_run, audio_seconds=ar.audio_seconds)
        total_s = time.perf_counter() - ar.t0
        timings = cpb.Timings(first_output_s=ar.first_output_s, total_s=total_s, process_prompt_s=self.process_s)
        self.outcome = "OK"
        self.metrics.finished(state.finish_reason, total_s, ar.audio_seconds)
        resp.final.CopyFrom(cpb.FinalEvent(usage=usage, timings=timings, finish_reason=state.finish_reason))
        return resp

    def _release(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if self.outcome != "OK":  # None: cancelled by the client going away (asyncio.CancelledError)
            self.metrics.failed(self.outcome or "CANCELLED", self.ar.audio_seconds)
        self.table.release(self.ar)
        self.table.active.pop(self.ar.request_id, None)
        self.by_client_id.pop((self.kid, self.rid), None)
        if self.kid:
            self.key_limits.release(self.kid)
