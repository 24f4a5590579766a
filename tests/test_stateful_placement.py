"""Placement refuses a layout that would split a stateful node's walks over node groups without
handing its state over (issue #51: BAGEL's decode on a group of its own answered every prompt alike)."""

from pathlib import Path

import pytest

from mstar import cli
from mstar.config import ConfigError, Placement, load_config, parse_config
from mstar.models.base import Model
from mstar.models.graph import INPUT, EngineType, GraphEdge, GraphNode, Loop, Walk
from mstar.models.registry import create_model

SHIPPED = sorted(Path(__file__).resolve().parents[1].joinpath("models").glob("*/configs/*.yaml"))

# the original M*'s serving page: BAGEL's prefill walks on one group, its decode walk on another
BAGEL_PER_WALK = """\
model: bagel
node_groups:
  - name: prefill
    node_names: [vit_encoder, vae_encoder, llm, vae_decoder]
    graph_walks: [prefill_text, prefill_vit, prefill_vae, export_kv, image_gen]
  - name: decode
    node_names: [llm]
    graph_walks: [decode]
"""


def test_bagel_decode_on_a_group_of_its_own_is_refused(tmp_path, capsys):
    cfg = tmp_path / "bagel_pd.yaml"
    cfg.write_text(BAGEL_PER_WALK)
    with pytest.raises(SystemExit) as e:
        cli.main(["check-config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for words in ("node 'llm' keeps per-request state (its K/V cache) between walks",
                  "group 'prefill': prefill_text, prefill_vit, prefill_vae, export_kv, image_gen; group 'decode': decode",
                  "walk 'decode' on group 'decode' would start without the state",
                  "Place walk 'decode' on group 'prefill'", "give walk 'decode' a K/V hand-off",
                  "GraphEdge(INPUT, 'llm', <name>, once=True)", "pd_disaggregated.yaml"):
        assert words in err, err


def test_bagel_decode_with_the_prefills_and_image_gen_handed_over_passes():
    """disaggregated.yaml's shape: image_gen away from the prefills reads export_kv's ctx_kv."""
    cfg = parse_config({"model": "bagel", "node_groups": [
        {"name": "und", "node_names": ["vit_encoder", "vae_encoder", "llm"],
         "graph_walks": ["prefill_text", "prefill_vit", "prefill_vae", "decode", "export_kv"]},
        {"name": "gen", "node_names": ["llm", "vae_decoder"], "graph_walks": ["image_gen"]}]})
    Placement(cfg, create_model("bagel", {}))


def test_qwen3_omni_thinker_split_between_prefill_and_decoding_is_refused():
    cfg = parse_config({"model": "qwen3_omni", "node_groups": [
        {"name": "a", "node_names": ["audio_encoder", "vision_encoder", "thinker"], "graph_walks": ["encode", "prefill"]},
        {"name": "b", "node_names": ["thinker", "talker", "code2wav"], "graph_walks": ["think", "speak", "code2wav_chunk"]}]})
    with pytest.raises(ConfigError, match="node 'thinker' keeps per-request state .* walk 'think' on group 'b'"):
        Placement(cfg, create_model("qwen3_omni", {}))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_shipped_layout_passes(path):
    cfg = load_config(path)
    Placement(cfg, create_model(cfg.model, cfg.model_kwargs))


def _pd_model(handoff: bool, persist_from: str = "prefill", engine: EngineType = EngineType.KV_CACHE) -> Model:
    """Orpheus' shape: prefill persists the K/V into its node; decode (a Loop) reads them once."""
    class PD(Model):
        name = "pd"
        nodes = (GraphNode("lm", engine),)

        def build_walks(self):
            prefill = [GraphEdge(INPUT, "lm", "prompt"), GraphEdge("lm", "lm", "token", persist=True)]
            decode = [GraphEdge(INPUT, "lm", "token"), GraphEdge("lm", "lm", "token")]
            if handoff:
                kv = [GraphEdge("lm", "lm", "kv", persist=True)]
                (prefill if persist_from == "prefill" else decode).extend(kv)
                decode.append(GraphEdge(INPUT, "lm", "kv", once=True))
            return [Walk("prefill", "lm", prefill), Walk("decode", Loop("lm", 8, stop_node="lm"), decode)]

    return PD()


SPLIT = [{"name": "p", "node_names": ["lm"], "graph_walks": ["prefill"]},
         {"name": "d", "node_names": ["lm"], "graph_walks": ["decode"]}]


def test_an_orpheus_like_handoff_passes():
    placement = Placement(parse_config({"model": "pd", "node_groups": SPLIT}), _pd_model(handoff=True))
    assert placement.persist_targets("lm", "kv") == ["d"]


def test_the_same_split_without_the_handoff_is_refused():
    with pytest.raises(ConfigError, match="node 'lm' keeps per-request state .* walk 'decode' on group 'd'"):
        Placement(parse_config({"model": "pd", "node_groups": SPLIT}), _pd_model(handoff=False))


def test_a_handoff_persisted_on_the_reading_group_itself_does_not_count():
    with pytest.raises(ConfigError, match="walk 'decode' on group 'd'"):
        Placement(parse_config({"model": "pd", "node_groups": SPLIT}), _pd_model(handoff=True, persist_from="decode"))


def test_one_group_or_a_stateless_node_needs_no_handoff():
    Placement(parse_config({"model": "pd", "node_groups": [{"node_names": ["lm"]}]}), _pd_model(handoff=False))
    Placement(parse_config({"model": "pd", "node_groups": SPLIT}), _pd_model(handoff=False, engine=EngineType.STATELESS))
