"""Placement config: which node group hosts which graph nodes, read from YAML and
validated against the model. Walks are split into per-node-group fragments here."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mstar.models.base import Model
from mstar.models.graph import INPUT, EngineType
from mstar.models.plan import EdgeKind


class ConfigError(ValueError):
    """The placement YAML cannot serve the model; the message says what to change."""


@dataclass(frozen=True)
class NodeGroupConfig:
    name: str
    node_names: tuple[str, ...]
    ranks: tuple[int, ...] = (0,)
    graph_walks: tuple[str, ...] | None = None  # None: every walk its nodes appear in
    # ranks of the group's one node, a process each: how the node splits its work over them is
    # its own (Megatron tensor parallelism for the LLM engines, a pass's rows for BAGEL's llm)
    tp_size: int = 1

    def serves(self, walk: str, node: str) -> bool:
        return node in self.node_names and (self.graph_walks is None or walk in self.graph_walks)


@dataclass(frozen=True)
class PlacementConfig:
    model: str
    node_groups: tuple[NodeGroupConfig, ...]
    max_seq_len: int = 4096
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    def group(self, name: str) -> NodeGroupConfig:
        for g in self.node_groups:
            if g.name == name:
                return g
        raise ConfigError(f"no node group named '{name}'. Groups: {', '.join(g.name for g in self.node_groups)}")

    @property
    def group_names(self) -> list[str]:
        return [g.name for g in self.node_groups]


def _expect(cond: object, msg: str) -> None:  # any truth value (an `isinstance(x, list) and x`)
    if not cond:
        raise ConfigError(msg)


def parse_config(data: Any, source: str = "config") -> PlacementConfig:
    _expect(isinstance(data, dict), f"{source}: expected a mapping with keys model, node_groups")
    unknown = set(data) - {"model", "max_seq_len", "node_groups", "model_kwargs"}
    _expect(not unknown, f"{source}: unknown keys {sorted(unknown)}; allowed: model, max_seq_len, node_groups, model_kwargs")
    model = data.get("model")
    _expect(isinstance(model, str) and model != "", f"{source}: 'model' must be a model name string")
    max_seq_len = data.get("max_seq_len", 4096)
    _expect(isinstance(max_seq_len, int) and max_seq_len > 0, f"{source}: max_seq_len must be a positive integer, got {max_seq_len!r}")
    kwargs = data.get("model_kwargs") or {}
    _expect(isinstance(kwargs, dict), f"{source}: model_kwargs must be a mapping")
    raw_groups = data.get("node_groups")
    _expect(isinstance(raw_groups, list) and raw_groups, f"{source}: node_groups must be a non-empty list")
    groups = []
    for i, g in enumerate(raw_groups):
        where = f"{source}: node_groups[{i}]"
        _expect(isinstance(g, dict), f"{where}: expected a mapping")
        bad = set(g) - {"name", "node_names", "ranks", "graph_walks", "tp_size"}
        _expect(not bad, f"{where}: unknown keys {sorted(bad)}; allowed: name, node_names, ranks, graph_walks, tp_size")
        names = g.get("node_names")
        _expect(isinstance(names, list) and names and all(isinstance(n, str) for n in names), f"{where}: node_names must be a non-empty list of node names")
        ranks = g.get("ranks", [0])
        _expect(isinstance(ranks, list) and ranks and all(isinstance(r, int) and r >= 0 for r in ranks), f"{where}: ranks must be a non-empty list of device indices")
        tp = g.get("tp_size", 1)
        _expect(isinstance(tp, int) and tp >= 1, f"{where}: tp_size must be a positive integer")
        _expect(len(ranks) == tp, f"{where}: tp_size={tp} needs {tp} ranks, got {ranks}")
        _expect(tp == 1 or len(names) == 1, f"{where}: tp_size={tp} splits one engine node over its ranks; "
                f"put {names} in separate node groups (a tensor-parallel group holds exactly one node)")
        walks = g.get("graph_walks")
        _expect(walks is None or (isinstance(walks, list) and all(isinstance(w, str) for w in walks)), f"{where}: graph_walks must be a list of walk names")
        name = g.get("name", f"group{i}")
        _expect(isinstance(name, str) and name.replace("_", "").replace("-", "").isalnum(), f"{where}: name must be letters, digits, '-' or '_'")
        groups.append(NodeGroupConfig(name, tuple(names), tuple(ranks), tuple(walks) if walks is not None else None, tp))
    seen = [g.name for g in groups]
    _expect(len(set(seen)) == len(seen), f"{source}: node group names must be unique, got {seen}")
    return PlacementConfig(model, tuple(groups), max_seq_len, kwargs)


def load_config(path: str | Path) -> PlacementConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(data, str(path))


def _spelling(name: str, known: list[str]) -> str:
    """"; M* spells it 'llm'" for a name known in another case or spelling (the original M* docs
    write node names such as LLM), else ""."""
    low = name.lower().replace("-", "_")
    same = [k for k in known if k.lower() == low] or [k for k in known if k.startswith(low) or low.startswith(k)]
    close = same or difflib.get_close_matches(low, known, n=1)
    return f" (M* spells it '{close[0]}')" if close else ""


class Placement:
    """A config checked against its model: who hosts each node of each walk."""

    def __init__(self, config: PlacementConfig, model: Model):
        self.config = config
        self.model = model
        model.max_seq_len = config.max_seq_len  # bounds prompts, sizes KV caches
        self._host: dict[tuple[str, str], str] = {}
        for g in config.node_groups:
            for n in g.node_names:
                _expect(n in model.node_names, f"node group '{g.name}': unknown node '{n}'{_spelling(n, model.node_names)}. "
                                               f"Model '{model.name}' has nodes: {', '.join(model.node_names)}")
            for w in g.graph_walks or ():
                _expect(w in model.walks, f"node group '{g.name}': unknown walk '{w}' in graph_walks. Walks: {', '.join(model.walks)}")
        for walk, plan in model.plans.items():
            for node in plan.nodes:
                hosts = [g.name for g in config.node_groups if g.serves(walk, node)]
                _expect(hosts != [], f"walk '{walk}': node '{node}' is not placed; add it to node_names of a group whose graph_walks include '{walk}'")
                _expect(len(hosts) == 1, f"walk '{walk}': node '{node}' is placed in several groups {hosts}; restrict them with graph_walks")
                self._host[(walk, node)] = hosts[0]
        self._check_streams_and_loops()
        self._check_stateful_nodes()

    def host(self, walk: str, node: str) -> str:
        return self._host[(walk, node)]

    def fragments(self, walk: str) -> list[str]:
        """Node groups taking part in a walk instance (chunk-walk hosts included)."""
        plan = self.model.plans[walk]
        groups = {self.host(walk, n) for n in plan.nodes}
        for e in plan.streams:
            assert e.topology is not None
            groups.add(self.host(e.topology.dst_walk, e.dst))
        return sorted(groups)

    def persist_targets(self, node: str, name: str) -> list[str]:
        """Groups that may read a value persisted for ``node`` under ``name``."""
        out = set()
        for walk, plan in self.model.plans.items():
            if any(e.src == INPUT and e.dst == node and e.name == name for e in plan.walk.edges):
                out.add(self.host(walk, node))
        return sorted(out)

    def loop_owner(self, walk: str, loop: str) -> str:
        lp = self.model.plans[walk].loops[loop]
        return self.host(walk, lp.stop_node or lp.nodes[0])

    def _check_streams_and_loops(self) -> None:
        for walk, plan in self.model.plans.items():
            for e in plan.streams:
                assert e.topology is not None
                dst_walk = e.topology.dst_walk
                hosts = {self.host(dst_walk, n) for n in self.model.plans[dst_walk].nodes}
                _expect(len(hosts) == 1, f"chunk walk '{dst_walk}' (fed by streaming edge '{e.name}') is split over groups {sorted(hosts)}; place it in one group")
            for lp in plan.loops.values():
                owner = self.loop_owner(walk, lp.name)
                for n in lp.nodes:
                    if self.host(walk, n) == owner:
                        continue
                    fed = any(p.kind is EdgeKind.DIRECT and p.edge.src in lp.nodes for p in plan.nodes[n].in_edges)
                    _expect(fed, f"walk '{walk}': loop node '{n}' runs in group '{self.host(walk, n)}', away from the loop's owner '{owner}', "
                                 f"but takes no same-iteration input from another loop node; place it with '{owner}'")

    def _check_stateful_nodes(self) -> None:
        """A node that keeps per-request state in its engine between walks (``EngineType.KV_CACHE``: its
        K/V caches) reads, in each walk, what its earlier walks of the request left in *its own group's*
        engine. Served on several groups (``graph_walks``), the group of its first walk (the model's walk
        order: prefill before decode) holds that state; a walk hosted anywhere else would start from
        nothing (BAGEL's ``decode`` away from its prefills answered every prompt alike) unless the state
        is handed over: an INPUT edge into the node (``once=True`` inside a Loop) whose name the node
        persists into itself in a walk on another group (Orpheus' ``kv``, BAGEL's ``ctx_kv``)."""
        for node in self.model.nodes:
            if node.engine is not EngineType.KV_CACHE:
                continue
            walks = [w for w, plan in self.model.plans.items() if node.name in plan.nodes]
            by_group: dict[str, list[str]] = {}
            for w in walks:
                by_group.setdefault(self.host(w, node.name), []).append(w)
            if len(by_group) < 2:
                continue
            home = self.host(walks[0], node.name)
            for group, ws in by_group.items():
                for w in ws:
                    if group == home or self._handed_over(w, node.name, group):
                        continue
                    where = "; ".join(f"group '{g}': {', '.join(gw)}" for g, gw in by_group.items())
                    raise ConfigError(
                        f"node '{node.name}' keeps per-request state (its K/V cache) between walks, and its walks are "
                        f"split over node groups ({where}): walk '{w}' on group '{group}' would start without the state its "
                        f"walks keep in the engine of group '{home}', and serve wrong output. "
                        f"Place walk '{w}' on group '{home}' with them (graph_walks), or give walk '{w}' a K/V hand-off: "
                        f"a GraphEdge(INPUT, '{node.name}', <name>, once=True) that a walk on group '{home}' persists with "
                        f"GraphEdge('{node.name}', '{node.name}', <name>, persist=True), as Orpheus' prefill and decode "
                        f"walks do (models/orpheus/configs/pd_disaggregated.yaml)")

    def _handed_over(self, walk: str, node: str, group: str) -> bool:
        """``walk`` reads ``node``'s state from another group: an INPUT edge into ``node`` whose name
        ``node`` persists into itself in a walk hosted on a group other than ``group``."""
        plan = self.model.plans[walk]
        in_loop = plan.nodes[node].loop is not None
        names = {e.name for e in plan.walk.edges if e.src == INPUT and e.dst == node and (e.once or not in_loop)}
        for other, p in self.model.plans.items():
            if node in p.nodes and self.host(other, node) != group and any(
                    e.persist and e.src == node and e.dst == node and e.name in names for e in p.walk.edges):
                return True
        return False
