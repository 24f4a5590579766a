"""Walk Graph validation, placement validation and the registry's errors."""

import pytest

from mstar.config import ConfigError, Placement, parse_config
from mstar.models.base import Model
from mstar.models.graph import (
    EMIT_TO_CLIENT,
    EMIT_TO_CONDUCTOR,
    INPUT,
    FixedChunks,
    GraphEdge,
    GraphError,
    GraphNode,
    Loop,
    Modality,
    PartitionTopology,
    Sequential,
    StreamingGraphEdge,
    Walk,
)
from mstar.models.plan import EdgeKind
from mstar.models.registry import UnknownModel, create_model, model_class


def make(walks, nodes=("a", "b", "c")):
    class M(Model):
        name = "m"

    M.nodes = tuple(GraphNode(n) for n in nodes)
    M.build_walks = lambda self: walks
    return M()


def test_edge_kinds_of_a_loop():
    m = make([Walk("w", Sequential("a", Loop(Sequential("b", "c"), 4, stop_node="c")), [
        GraphEdge(INPUT, "a", "x"), GraphEdge("a", "b", "h"), GraphEdge("b", "c", "y"), GraphEdge("c", "b", "h"),
        GraphEdge("c", EMIT_TO_CLIENT, "tok", modality=Modality.TEXT)]), ], nodes=("a", "b", "c"))
    kinds = {(p.edge.src, p.edge.dst, p.edge.name): p.kind for n in m.plans["w"].nodes.values() for p in n.out_edges}
    assert kinds[("a", "b", "h")] is EdgeKind.ENTRY
    assert kinds[("b", "c", "y")] is EdgeKind.DIRECT
    assert kinds[("c", "b", "h")] is EdgeKind.CARRIED
    assert kinds[("c", EMIT_TO_CLIENT, "tok")] is EdgeKind.EMIT


def test_emits_at_a_loop_end_and_to_the_conductor():
    m = make([Walk("w", Loop(Sequential("a", "b"), 4, stop_node="b", accumulate=frozenset({"all"})), [
        GraphEdge("a", "b", "x"), GraphEdge("b", EMIT_TO_CLIENT, "last", modality=Modality.TEXT, at_loop_end=True),
        GraphEdge("a", EMIT_TO_CONDUCTOR, "why", at_loop_end=True), GraphEdge("b", EMIT_TO_CONDUCTOR, "all", at_loop_end=True),
        GraphEdge("b", EMIT_TO_CONDUCTOR, "each")])])
    kinds = {(p.edge.src, p.edge.name): p.kind for n in m.plans["w"].nodes.values() for p in n.out_edges}
    assert kinds[("b", "last")] is kinds[("a", "why")] is kinds[("b", "all")] is EdgeKind.EMIT_AT_END
    assert kinds[("b", "each")] is EdgeKind.EMIT
    assert m.outputs == {"last": Modality.TEXT}  # values for the conductor are no client outputs


@pytest.mark.parametrize("walks,message", [
    ([Walk("w", Sequential("a", "zz"), [])], "unknown node 'zz'"),
    ([Walk("w", Sequential("a"), [GraphEdge("b", "a", "x")])], "starts at 'b', which does not run in this walk"),
    ([Walk("w", Sequential("a"), [GraphEdge("a", "b", "x")])], "mark it persist=True"),
    ([Walk("w", Sequential("a", "b"), [GraphEdge("b", "a", "x")])], "goes backwards outside a loop"),
    ([Walk("w", Loop("a", 0), [])], "max_iters >= 1"),
    ([Walk("w", Loop(Loop("a", 2, name="in"), 2), [])], "nested"),
    ([Walk("w", Loop("a", 2, stop_node="b"), [])], "stop_node 'b' is not in the loop body"),
    ([Walk("w", Loop("a", 2, accumulate=frozenset({"q"})), [])], "accumulates 'q'"),
    ([Walk("w", "a", [GraphEdge("a", EMIT_TO_CLIENT, "x")])], "needs a modality"),
    ([Walk("w", "a", [GraphEdge("a", EMIT_TO_CONDUCTOR, "x", at_loop_end=True)])], "at_loop_end needs 'a' inside a Loop"),
    ([Walk("w", Sequential(Loop("a", 2), "b"), [GraphEdge("a", "b", "x", at_loop_end=True)])],
     "at_loop_end is for edges to EMIT_TO_CLIENT or EMIT_TO_CONDUCTOR"),
    ([Walk("w", "a", [GraphEdge("a", EMIT_TO_CLIENT, "x", modality=Modality.TEXT), GraphEdge("a", EMIT_TO_CONDUCTOR, "x")])],
     "'x' goes both to the client and to EMIT_TO_CONDUCTOR"),
    ([Walk("w", Sequential("a", "b"), [GraphEdge("a", "b", "x"), GraphEdge("a", "b", "x")])], "from two edges"),
    ([Walk("w", Loop("a", 3), [StreamingGraphEdge("a", "b", "s", policy=FixedChunks(2))])],
     "does not run in this walk; a stream without topology feeds a running loop"),
    ([Walk("w", "a", [GraphEdge(INPUT, "a", "x", once=True)])], "once=True is for a value entering a Loop"),
    ([Walk("w", Loop(Sequential("a", "b"), 3), [GraphEdge("a", "b", "x", once=True)])], "takes it inside its loop"),
    ([Walk("w", Loop("a", 3), [StreamingGraphEdge("a", "b", "s", topology=PartitionTopology("w", "nope"))])],
     "dst_walk 'nope' is not a walk"),
    ([Walk("w", Loop("a", 3), [StreamingGraphEdge("a", "b", "s", topology=PartitionTopology("w", "v"))]),
      Walk("v", "b", [])], "needs an edge GraphEdge(INPUT, 'b', 's')"),
])
def test_graph_errors_say_what_to_fix(walks, message):
    with pytest.raises(GraphError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make(walks)


def toy_cfg(groups, **extra):
    return parse_config({"model": "toy", "node_groups": groups, **extra})


ALL = ["rot", "keep", "combine", "decoder", "tally", "synth", "meter", "captioner", "echo", "blob_source", "blob_sink"]


@pytest.mark.parametrize("data,message", [
    ({"model": "toy"}, "node_groups must be a non-empty list"),
    ({"model": "toy", "node_groups": [{"node_names": ALL, "ranks": [0], "tp_size": 2}]}, r"tp_size=2 needs 2 ranks, got \[0\]"),
    ({"model": "toy", "node_groups": [{"node_names": ALL, "ranks": [0, 1], "tp_size": 2}]},
     "a tensor-parallel group holds exactly one node"),
    ({"model": "toy", "node_groups": [{"node_names": ALL, "colour": 1}]}, "unknown keys"),
    ({"model": "toy", "max_seq_len": -3, "node_groups": [{"node_names": ALL}]}, "max_seq_len"),
    ({"model": "toy", "node_groups": [{"node_names": ALL, "name": "x"}, {"node_names": ["rot"], "name": "x"}]}, "unique"),
])
def test_config_shape_errors(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


@pytest.mark.parametrize("groups,message", [
    ([{"node_names": ALL + ["ghost"]}], "unknown node 'ghost'"),
    ([{"node_names": ALL[:-1]}], "node 'blob_sink' is not placed"),
    ([{"node_names": ALL}, {"node_names": ["rot"]}], "placed in several groups"),
    ([{"node_names": ALL, "graph_walks": ["nope"]}], "unknown walk 'nope'"),
    ([{"node_names": [n for n in ALL if n != "captioner"]}, {"node_names": ["captioner"], "graph_walks": ["speak"]}],
     "node 'captioner' is not placed"),
])
def test_placement_errors(groups, message):
    with pytest.raises(ConfigError, match=message):
        Placement(toy_cfg(groups), create_model("toy"))


def test_chunk_walk_must_sit_in_one_group():
    class M(Model):
        name = "m"
        nodes = (GraphNode("a"), GraphNode("b"), GraphNode("c"))

        def build_walks(self):
            return [Walk("w", Loop("a", 3), [StreamingGraphEdge("a", "b", "s", topology=PartitionTopology("w", "v"))]),
                    Walk("v", Sequential("b", "c"), [GraphEdge(INPUT, "b", "s"), GraphEdge("b", "c", "t")])]

    cfg = parse_config({"model": "m", "node_groups": [{"name": "g1", "node_names": ["a", "b"]}, {"name": "g2", "node_names": ["c"]}]})
    with pytest.raises(ConfigError, match="chunk walk 'v'"):
        Placement(cfg, M())


def test_split_loop_needs_same_iteration_feed():
    class M(Model):
        name = "m"
        nodes = (GraphNode("a"), GraphNode("b"))

        def build_walks(self):
            return [Walk("w", Loop(Sequential("a", "b"), 3, stop_node="b"), [GraphEdge("b", "a", "x")])]

    cfg = parse_config({"model": "m", "node_groups": [{"name": "g1", "node_names": ["a"]}, {"name": "g2", "node_names": ["b"]}]})
    with pytest.raises(ConfigError, match="takes no same-iteration input"):
        Placement(cfg, M())


def test_same_node_in_two_groups_by_walk():
    groups = [{"name": "enc", "node_names": ["rot", "keep", "combine", "blob_source"]},
              {"name": "dec", "node_names": ["decoder", "tally", "synth", "meter", "captioner", "echo", "blob_sink"]}]
    p = Placement(toy_cfg(groups), create_model("toy"))
    assert p.fragments("encode") == ["enc"] and p.fragments("generate") == ["dec"]
    assert p.persist_targets("decoder", "text_state") == ["dec"]


def test_registry_lists_known_models():
    with pytest.raises(UnknownModel) as e:
        model_class("tyo")
    assert "Unknown model 'tyo'. Known: " in str(e.value) and "toy" in str(e.value)


def test_a_node_may_persist_a_value_for_itself():
    m = make([Walk("prefill", "a", [GraphEdge(INPUT, "a", "x"), GraphEdge("a", "a", "first", persist=True)]),
              Walk("decode", Loop("a", 4), [GraphEdge(INPUT, "a", "first")])], nodes=("a",))
    (pe,) = [p for p in m.plans["prefill"].nodes["a"].out_edges]
    assert pe.kind is EdgeKind.PERSIST
