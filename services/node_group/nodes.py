"""The node group's nodes: made from the model, and run a batch of calls at a time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from mstar import nvtx
from mstar.config import Placement
from mstar.models.base import EngineNode, Model, NodeCall, NodeContext, NodeSubmodule
from mstar.services.engines.tensor_parallel import TPSpec
from mstar.services.node_group.engine_driver import EngineDriver
from mstar.services.node_group.whole_loops import WholeLoops

log = logging.getLogger(__name__)


def create_submodules(model: Model, placement: Placement, group: str, device: str, cache_dir: str | None,
                      tp: TPSpec | None = None) -> dict[str, NodeSubmodule]:
    """The group's nodes; with ``tp``, each must join the tensor-parallel ranks."""
    cfg = placement.config.group(group)
    walks = {n: frozenset(w for w, plan in model.plans.items() if n in plan.nodes and placement.host(w, n) == group)
             for n in cfg.node_names}
    subs = {n: model.create_submodule(NodeContext(n, device, cache_dir, placement.config.model_kwargs, tp, walks[n]))
            for n in cfg.node_names}
    if tp is not None:
        for n, sub in subs.items():
            if sub.tensor_parallel is None:
                raise ValueError(f"node group '{group}' has tp_size={tp.size}, but node '{n}' of model "
                                 f"'{model.name}' does not run tensor-parallel; use tp_size 1")
    return subs


class Nodes:
    """Stateless nodes run here (``execute``), on a worker thread when blocking; each engine
    node has an EngineDriver, stepping on an engine thread of its own."""

    def __init__(self, model: Model, placement: Placement, group: str, device: str, cache_dir: str | None,
                 tp: TPSpec | None, local: dict[str, tuple[str, ...]], wake: Callable[[], None]):
        self.submodules = create_submodules(model, placement, group, device, cache_dir, tp)
        self.engines = {n: s for n, s in self.submodules.items() if isinstance(s, EngineNode)}
        self.whole_loops = WholeLoops(model, local, self.submodules)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{group}-forward")
        self._engine_threads = ThreadPoolExecutor(max_workers=max(1, len(self.engines)), thread_name_prefix=f"{group}-engine")
        self.drivers = {n: EngineDriver(n, s, self._engine_threads, wake) for n, s in self.engines.items()}

    async def execute(self, loop: asyncio.AbstractEventLoop, walk: str, node: str, calls: list[NodeCall]) -> list:
        """A node's forward over the batch (its whole loop for a LoopBodyNode): each call's
        outputs, or the exception it raised. A batch that raises runs again one call at a time,
        so only the failing requests fail."""
        sub = self.submodules[node]
        whole = (walk, node) in self.whole_loops

        def forward(batch_calls):
            with nvtx.span(f"{walk}/{node} x{len(batch_calls)}") if nvtx.ACTIVE else nvtx.NULL:
                if whole:
                    return self.whole_loops.run(walk, node, batch_calls)
                return sub.forward(sub.prepare_inputs(batch_calls))

        async def run(batch_calls):
            if sub.is_blocking(batch_calls):
                return await loop.run_in_executor(self._executor, forward, batch_calls)
            return forward(batch_calls)

        try:
            return await run(calls)
        except Exception as e:
            if len(calls) == 1:
                return [e]
        results = []
        for c in calls:
            try:
                results.append((await run([c]))[0])
            except Exception as e:
                results.append(e)
        return results

    def release(self, request_id: str) -> None:
        for node, sub in self.submodules.items():
            driver = self.drivers.get(node)
            if driver is not None:
                driver.release(request_id)  # its engine frees the pages with its next step
            else:
                sub.release(request_id)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for driver in self.drivers.values():  # on the engine's thread: after its last step
            try:
                await loop.run_in_executor(self._engine_threads, driver.close)
            except Exception:
                log.exception("closing the engine of node '%s' failed", driver.node)
        for node, sub in self.submodules.items():  # ranks 1.. released on the forward thread, after its last call
            if node not in self.drivers and sub.tensor_parallel is not None:
                try:
                    await loop.run_in_executor(self._executor, sub.close)
                except Exception:
                    log.exception("closing node '%s' failed", node)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._engine_threads.shutdown(wait=False, cancel_futures=True)
