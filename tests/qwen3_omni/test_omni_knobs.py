"""Qwen3-Omni's typed knobs: the YAML's and a request's, the registry and the gateway's OpenAPI."""

import pytest

from mstar.models.base import InvalidArgument
from mstar.models.knobs import KnobError
from mstar.models.qwen3_omni.knobs import OmniRequest, OmniServeConfig
from mstar.models.registry import create_model, request_schemas


def test_request_defaults_and_errors_name_the_key():
    model = create_model("qwen3_omni")
    kw = model.validate_kwargs({})
    assert kw["modalities"] == ["text", "audio"] and kw["voice"] == "ethan" and kw["talker_top_k"] == 50
    for bad, key in (({"modalities": ["video"]}, "model_kwargs.modalities"), ({"speaker": "x"}, "model_kwargs.speaker"),
                     ({"top_p": 0}, "model_kwargs.top_p"), ({"max_audio_frames": 10**6}, "model_kwargs.max_audio_frames")):
        with pytest.raises(InvalidArgument) as e:
            model.validate_kwargs(bad)
        assert e.value.field == key
    with pytest.raises(KnobError, match="code2wav_chunk_frames"):
        OmniServeConfig.parse({"code2wav_chunk_frames": 0})


def test_the_gateway_documents_the_request_knobs():
    from openapi_spec_validator import validate

    from mstar.gateway.generate import GatewaySettings
    from mstar.gateway.openapi import build

    assert request_schemas()["qwen3_omni"] is OmniRequest
    spec = build(GatewaySettings("127.0.0.1:1", 1 << 20, 300.0))
    validate(spec)
    props = spec["components"]["schemas"]["Qwen3OmniModelKwargs"]["properties"]
    assert props["modalities"]["default"] == ["text", "audio"] and "voice" in props
