"""Orpheus' typed knobs reach its nodes, and the placement's max_seq_len bounds its prompts and
sizes its KV cache."""

import pytest

from mstar.config import Placement, parse_config
from mstar.models.base import InvalidArgument, NodeContext, Prompt
from mstar.models.registry import create_model


def placed(weights, max_seq_len, **model_kwargs):
    model = create_model("orpheus", model_kwargs, weights)
    Placement(parse_config({"model": "orpheus", "max_seq_len": max_seq_len, "model_kwargs": model_kwargs,
                            "node_groups": [{"node_names": ["llm", "snac_decoder"]}]}), model)
    return model


def test_max_seq_len_bounds_prompts(weights):
    model = placed(weights, 64)
    model.prepare_conductor()
    model.process_prompt(Prompt("Hi.", [], model.validate_kwargs({"max_tokens": 8})))
    with pytest.raises(InvalidArgument, match=r"text: prompt is \d+ tokens; with max_tokens=60 at most 4 fit in "
                                              r"max_seq_len=64"):
        model.process_prompt(Prompt("Hi.", [], model.validate_kwargs({"max_tokens": 60})))


def test_max_seq_len_reaches_the_engine(weights):
    model = placed(weights, 96, engine_process=False, kv_cache_bytes=8 << 20, page_size=16)
    llm = model.create_submodule(NodeContext("llm", "cpu", weights, model.model_kwargs))
    try:
        assert llm.engine.engine.config.max_seq_len == 96
        assert llm.engine.engine.scheduler.config.max_pages_per_seq == 6
    finally:
        llm.close()
    too_long = placed(weights, 1 << 20, engine_process=False, kv_cache_bytes=8 << 20)
    with pytest.raises(ValueError, match=r"fewer than one sequence of max_seq_len=1048576"):
        too_long.create_submodule(NodeContext("llm", "cpu", weights, too_long.model_kwargs))
