"""The /generate NDJSON lines are built as text (gateway.convert.chunk_line): they must be the
very bytes json.dumps writes for the documented objects (chunk_json / final_json)."""

import json
import math
import struct

import pytest

from mstar.gateway.convert import ProtocolError, chunk_json, chunk_line, final_json, message_lines
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import tensor_pb2


def _dumps(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


CHUNKS = [
    cpb.OutputChunk(name="text", modality=cpb.MODALITY_TEXT, text="Hel", index=0, elapsed_s=0.1, token_ids=[72, 101]),
    cpb.OutputChunk(name="text", modality=cpb.MODALITY_TEXT, text="", index=7, elapsed_s=1e-05, token_ids=[1]),
    cpb.OutputChunk(name="t\u00e9xt \"q\" \\ \n\t\x01", modality=cpb.MODALITY_TEXT, text="h\u00e9 \U0001f600 \u2028 </",
                    index=4_000_000_000, elapsed_s=123456.789, token_ids=[-(2**63), 2**63 - 1, 0]),
    cpb.OutputChunk(name="caption", modality=cpb.MODALITY_TEXT, text="\ufffd", elapsed_s=3e20),
    cpb.OutputChunk(name="audio", modality=cpb.MODALITY_AUDIO, data=struct.pack("<3h", 1, -2, 3), mime_type="audio/pcm",
                    sample_rate_hz=24000, index=2, elapsed_s=0.2),
    cpb.OutputChunk(name="audio", modality=cpb.MODALITY_AUDIO, elapsed_s=0.0),  # no data, no rate: keys still there
    cpb.OutputChunk(name="image", modality=cpb.MODALITY_IMAGE, data=bytes(range(256)) * 3, mime_type="image/png"),
    cpb.OutputChunk(name="levels", modality=cpb.MODALITY_LATENT, elapsed_s=2.5,
                    tensor=tensor_pb2.Tensor(name="levels", datatype="FP32", shape=[2, 2], raw=struct.pack("<4f", 1, 2, 3, 4))),
    cpb.OutputChunk(name="act", modality=cpb.MODALITY_ACTION),  # a tensor modality without a tensor
    # actions also as JSON numbers ("values"); BF16 has no exact JSON form: bytes only
    cpb.OutputChunk(name="actions", modality=cpb.MODALITY_ACTION, tensor=tensor_pb2.Tensor(
        name="actions", datatype="FP32", shape=[2, 3], raw=struct.pack("<6f", 0.1, -2, 3.5, float("nan"), 1e-8, 7))),
    cpb.OutputChunk(name="actions", modality=cpb.MODALITY_ACTION, tensor=tensor_pb2.Tensor(
        name="actions", datatype="BF16", shape=[1], raw=b"\x80\x3f")),
    cpb.OutputChunk(name="scalar", modality=cpb.MODALITY_LATENT,
                    tensor=tensor_pb2.Tensor(name="s", datatype="INT64", raw=struct.pack("<q", 5))),
    cpb.OutputChunk(name="odd", modality=cpb.MODALITY_UNSPECIFIED, text="x", data=b"y", sample_rate_hz=8000,
                    tensor=tensor_pb2.Tensor(name="z", datatype="UINT8", shape=[1], raw=b"z"), token_ids=[3, 4]),
    cpb.OutputChunk(name="unknown", modality=99, elapsed_s=float("nan")),  # a modality newer than this gateway
    cpb.OutputChunk(name="inf", modality=cpb.MODALITY_TEXT, elapsed_s=float("inf")),
    cpb.OutputChunk(name="ninf", modality=cpb.MODALITY_TEXT, elapsed_s=float("-inf")),
]


@pytest.mark.parametrize("chunk", CHUNKS, ids=[f"{i}-{c.name[:6]}" for i, c in enumerate(CHUNKS)])
def test_chunk_line_is_json_dumps_of_chunk_json(chunk):
    assert chunk_line(chunk) == _dumps(chunk_json(chunk))


def test_elapsed_values_format_as_json_does():
    for x in (0.1, 1 / 3, 1e-7, 5e-324, 1.7976931348623157e308, 1e16, 123.0, -0.0, 0.0, math.pi * 1e10):
        c = cpb.OutputChunk(name="text", modality=cpb.MODALITY_TEXT, elapsed_s=x)
        assert chunk_line(c) == _dumps(chunk_json(c))


def test_a_shared_memory_tensor_is_a_protocol_error():
    c = cpb.OutputChunk(name="levels", modality=cpb.MODALITY_LATENT,
                        tensor=tensor_pb2.Tensor(name="levels", datatype="FP32", shape=[1],
                                                 shm=tensor_pb2.SharedMemoryRef(segment="s", nbytes=4)))
    with pytest.raises(ProtocolError):
        chunk_json(c)
    with pytest.raises(ProtocolError):
        chunk_line(c)


def test_message_lines_are_the_chunks_then_the_final_event():
    final = cpb.FinalEvent(usage=cpb.Usage(prompt_tokens=4, completion_tokens=3, walks=2, audio_seconds=0.5),
                           timings=cpb.Timings(first_output_s=0.1, total_s=0.6, process_prompt_s=0.01), finish_reason="stop")
    msg = cpb.GenerateResponse(request_id="r\u00e9q", chunks=CHUNKS[:5], final=final)
    want = "".join(_dumps(chunk_json(c)) + "\n" for c in msg.chunks) + _dumps(final_json(final, msg.request_id)) + "\n"
    assert message_lines(msg) == want.encode()
    assert message_lines(cpb.GenerateResponse(request_id="r", chunks=CHUNKS[:1])) == (_dumps(chunk_json(CHUNKS[0])) + "\n").encode()
    assert message_lines(cpb.GenerateResponse(request_id="r", final=final)) == (_dumps(final_json(final, "r")) + "\n").encode()


def test_action_values_are_the_tensor_and_a_short_tensor_is_a_protocol_error():
    c = next(c for c in CHUNKS if c.name == "actions")
    values = json.loads(chunk_line(c))["tensor"]["values"]
    assert len(values) == 2 and values[0] == [struct.unpack("<f", struct.pack("<f", 0.1))[0], -2.0, 3.5]
    assert math.isnan(values[1][0]) and values[1][2] == 7.0
    short = cpb.OutputChunk(name="actions", modality=cpb.MODALITY_ACTION, tensor=tensor_pb2.Tensor(
        name="actions", datatype="FP32", shape=[2, 3], raw=struct.pack("<5f", *range(5))))
    with pytest.raises(ProtocolError, match="20 bytes do not make FP32"):
        chunk_line(short)
    with pytest.raises(ProtocolError, match="20 bytes do not make FP32"):
        chunk_json(short)
