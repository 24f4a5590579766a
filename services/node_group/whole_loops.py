"""Whole loops: the Loop of a ``LoopBodyNode`` runs all its iterations in one call per batch of
requests (``LoopGraphs``: one CUDA graph replay per batch bucket on CUDA, eager elsewhere)."""

from __future__ import annotations

import torch

from mstar.models.base import LoopBodyNode, Model, NodeCall, NodeSubmodule
from mstar.models.plan import EdgeKind, WalkPlan
from mstar.services.engines.loop_graph import LoopGraphs

#: what may leave a whole loop: values for its next iteration, and its values at the end
WHOLE_LOOP_EDGES = (EdgeKind.CARRIED, EdgeKind.EXIT, EdgeKind.EMIT_AT_END)


def unsupported(plan: WalkPlan, node: str) -> str | None:
    """Why ``node``'s loop in this walk cannot run as one call, or None."""
    np_ = plan.nodes[node]
    lp = np_.loop
    if lp is None:
        return "it runs outside a Loop"
    if lp.nodes != (node,):
        return f"its loop '{lp.name}' also holds {[n for n in lp.nodes if n != node]}; a whole loop has one node"
    if lp.stop_node is not None:
        return f"its loop '{lp.name}' has a stop_node; a whole loop runs its max_iters iterations"
    if lp.accumulate:
        return f"its loop '{lp.name}' accumulates {sorted(lp.accumulate)}; a whole loop gives its last iteration's values"
    for pe in np_.out_edges:
        if pe.kind not in WHOLE_LOOP_EDGES:
            return f"its edge '{pe.edge.name}' to '{pe.edge.dst}' fires every iteration ({pe.kind.value})"
    return None


class WholeLoops:
    def __init__(self, model: Model, local: dict[str, tuple[str, ...]], submodules: dict[str, NodeSubmodule]):
        """``local``: each walk's nodes hosted here. Raises ValueError for a LoopBodyNode whose
        loop cannot run whole (a model error, found at start-up)."""
        self.loops: dict[tuple[str, str], LoopGraphs] = {}
        for walk, plan in model.plans.items():
            for node in local[walk]:
                sub = submodules[node]
                if not isinstance(sub, LoopBodyNode):
                    continue
                why = unsupported(plan, node)
                if why is not None:
                    raise ValueError(f"model '{model.name}', walk '{walk}': node '{node}' is a LoopBodyNode, but {why}")
                lp = plan.nodes[node].loop
                assert lp is not None
                carried = tuple(sorted(plan.nodes[node].carried_slots))
                loops = self.loops[(walk, node)] = LoopGraphs(sub.step, lp.max_iters, carried, sub.device,
                                                              sub.graph_buckets, name=f"{walk}/{node}")
                example = sub.example_inputs()
                if example is not None:  # every bucket made before serving: no request pays for a first use
                    loops.warm(example)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self.loops

    def run(self, walk: str, node: str, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        """Every iteration for a batch of calls (their inputs stacked on a new dim 0): each call's
        outputs of the last iteration."""
        names = list(calls[0].inputs)
        out = self.loops[(walk, node)].run({k: torch.stack([c.inputs[k] for c in calls]) for k in names})
        return [{k: v[i] for k, v in out.items()} for i in range(len(calls))]
