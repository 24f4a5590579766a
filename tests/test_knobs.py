"""Typed knobs (models/knobs.py): every model's YAML model_kwargs and request model_kwargs are a
schema that refuses unknown keys naming the known ones; the gateway's OpenAPI document shows the
same schemas; the placement's max_seq_len reaches the model; other spellings name ours."""

import re

import pytest

from mstar.config import ConfigError, Placement, parse_config
from mstar.models.base import InvalidArgument, Prompt
from mstar.models.knobs import KnobError
from mstar.models.orpheus.knobs import OrpheusConfig, OrpheusRequest
from mstar.models.registry import create_model, known_models, model_class, request_schemas
from mstar.models.toy.knobs import ToyRequest


def test_unknown_request_knobs_name_the_known_ones_and_a_close_match():
    with pytest.raises(KnobError) as e:
        OrpheusRequest.parse({"tempreature": 0.5}, model="orpheus", sep=": ")
    assert str(e.value) == ("model_kwargs.tempreature: unknown key for model 'orpheus'; did you mean 'temperature'? "
                            "known: max_tokens, repetition_penalty, seed, temperature, top_p, voice")
    assert e.value.key == "model_kwargs.tempreature"


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": True}, "model_kwargs.temperature: must be a number in [0, 2], got True"),
    ({"temperature": "0.5"}, "model_kwargs.temperature: must be a number in [0, 2], got '0.5'"),
    ({"top_p": 0}, "model_kwargs.top_p: must be a number in (0, 1], got 0"),
    ({"max_tokens": 1.0}, "model_kwargs.max_tokens: must be an integer in [7, 8192], got 1.0"),
    ({"voice": "bob"}, "model_kwargs.voice: must be one of tara, leah, jess, leo, dan, mia, zac, zoe, got 'bob'"),
    ({"max_output_tokens": 10}, "model_kwargs.max_output_tokens: not a knob of this model: M* calls it max_tokens"),
])
def test_request_knobs_are_strictly_typed(kwargs, message):
    with pytest.raises(KnobError, match="^" + re.escape(message) + "$"):
        OrpheusRequest.parse(kwargs, sep=": ")


def test_a_size_off_the_models_step_states_the_step():
    from mstar.models.bagel.schema import BagelRequest

    with pytest.raises(KnobError, match=re.escape("model_kwargs.width: must be an integer in [16, 1024], a multiple "
                                                  "of 16, got 770")):
        BagelRequest.parse({"width": 770}, sep=": ")


def test_a_request_gets_the_defaults_and_keeps_its_values():
    assert OrpheusRequest.parse({"temperature": 1, "seed": 3}).given() == {
        "voice": "tara", "temperature": 1.0, "top_p": 0.8, "repetition_penalty": 1.3, "max_tokens": 1200, "seed": 3}
    assert ToyRequest.parse({}).given()["max_tokens"] == 256


def test_the_models_refuse_bad_request_knobs_as_invalid_argument():
    with pytest.raises(InvalidArgument) as e:
        create_model("toy").validate_kwargs({"max_new_tokens": 4})
    assert e.value.field == "model_kwargs.max_new_tokens" and "M* calls it max_tokens" in str(e.value)


def test_yaml_model_kwargs_are_checked_when_the_model_is_made():
    with pytest.raises(ValueError, match=r"model_kwargs.snac_dtyp: unknown key for model 'orpheus'; did you mean "
                                         r"'snac_dtype'\? known: constrain_codes, .*"):
        create_model("orpheus", {"snac_dtyp": "bfloat16"})
    with pytest.raises(ValueError, match=r"model_kwargs.max_num_seqs must be an integer >= 1 or null, got '64'"):
        create_model("orpheus", {"max_num_seqs": "64"})
    with pytest.raises(ValueError, match=r"model_kwargs.max_seq_len: not a knob of this model: set max_seq_len at "
                                         r"the top level"):
        create_model("orpheus", {"max_seq_len": 8192})
    with pytest.raises(ValueError, match=r"model_kwargs.voice: unknown key for model 'toy'; known: $"):
        create_model("toy", {"voice": "tara"})
    assert create_model("orpheus", {"snac_dtype": "bfloat16"}).config.snac_dtype == "bfloat16"


def test_check_config_names_a_bad_knob(tmp_path, capsys):
    from mstar import cli

    cfg = tmp_path / "o.yaml"
    cfg.write_text("model: orpheus\nmodel_kwargs: {snac_dtype: fp8}\nnode_groups:\n  - node_names: [llm, snac_decoder]\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["check-config", str(cfg)])
    assert e.value.code == 2
    assert "model_kwargs.snac_dtype must be one of auto, float32, bfloat16, float16, got 'fp8'" in capsys.readouterr().err


def test_node_names_in_another_spelling_name_ours():
    model = create_model("orpheus")
    with pytest.raises(ConfigError, match=r"unknown node 'LLM' \(M\* spells it 'llm'\)"):
        Placement(parse_config({"model": "orpheus", "node_groups": [{"node_names": ["LLM", "snac_decoder"]}]}), model)
    with pytest.raises(ConfigError, match=r"unknown node 'snac' \(M\* spells it 'snac_decoder'\)"):
        Placement(parse_config({"model": "orpheus", "node_groups": [{"node_names": ["llm", "snac"]}]}), model)


def test_the_engine_choices_agree_with_the_engine():
    import typing

    from mstar.models.orpheus.snac_node import SNAC_DTYPES, SNAC_KERNELS
    from mstar.services.engines.cuda_graphs import DOWN_GEMM, FUSED_NORMS, GRAPH_ATTENTION, PROJ_GEMM
    from mstar.services.engines.kv_engine import FUSED_SAMPLER
    from mstar.services.engines.pdl import PDL_MODES

    def choices(name):
        return tuple(typing.get_args(OrpheusConfig.model_fields[name].annotation))

    assert choices("graph_attention") == GRAPH_ATTENTION and choices("fused_norms") == FUSED_NORMS
    assert choices("down_gemm") == DOWN_GEMM and choices("proj_gemm") == PROJ_GEMM and choices("pdl") == PDL_MODES
    assert choices("fused_sampler") == tuple(FUSED_SAMPLER)
    assert choices("snac_dtype") == ("auto", *SNAC_DTYPES) and choices("snac_kernels") == SNAC_KERNELS


def test_every_model_declares_its_schemas_once():
    schemas = request_schemas()
    for name in known_models():
        cls = model_class(name)
        if not cls.__module__.startswith("mstar.models."):
            continue  # a test's own model (other test modules register some)
        assert cls.request_schema is schemas[name] and cls.config_schema is not None, name


def test_the_openapi_document_shows_the_models_request_knobs():
    from openapi_spec_validator import validate

    from mstar.gateway.generate import GatewaySettings
    from mstar.gateway.openapi import build

    spec = build(GatewaySettings("127.0.0.1:1", 1 << 20, 300.0))
    validate(spec)
    components = spec["components"]["schemas"]
    assert components["OrpheusModelKwargs"] == OrpheusRequest.json_schema()
    assert components["ToyModelKwargs"] == ToyRequest.json_schema()
    props = components["OrpheusModelKwargs"]["properties"]
    assert props["max_tokens"] == {"default": 1200,
                                   "description": "speech tokens at most (7 per 85 ms frame; at least one frame)",
                                   "maximum": 8192, "minimum": 7, "type": "integer"}
    assert components["OrpheusModelKwargs"]["additionalProperties"] is False


def test_max_seq_len_bounds_the_toys_prompts():
    model = create_model("toy")
    Placement(parse_config({"model": "toy", "max_seq_len": 8, "node_groups": [
        {"node_names": [n.name for n in model.nodes]}]}), model)
    assert model.max_seq_len == 8
    model.process_prompt(Prompt("12345678", [], model.validate_kwargs({})))
    with pytest.raises(InvalidArgument, match="text: at most 8 bytes, got 9"):
        model.process_prompt(Prompt("123456789", [], model.validate_kwargs({})))
