"""The one place the gateway converts between its JSON and the Conductor protobufs."""

from __future__ import annotations

import base64
import binascii
import json
from json.encoder import encode_basestring_ascii

import numpy as np

from mstar.gateway.body import GenerateBody
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import tensor_pb2

MODALITY = {cpb.MODALITY_UNSPECIFIED: "unspecified", cpb.MODALITY_TEXT: "text", cpb.MODALITY_IMAGE: "image",
            cpb.MODALITY_AUDIO: "audio", cpb.MODALITY_ACTION: "action", cpb.MODALITY_LATENT: "latent"}
_BYTES = ("image", "audio")
_TENSORS = ("action", "latent")


class ProtocolError(Exception):
    """The conductor sent something the public API does not allow."""


def to_request(body: GenerateBody) -> cpb.GenerateRequest:
    """Spilled files are read from the upload dir here (generate.py calls this as gRPC sends)."""
    files = [cpb.InputFile(name=f.name, content_type=f.content_type, data=f.read()) for f in body.files]
    return cpb.GenerateRequest(model=body.model, text=body.text, files=files,
                               model_kwargs_json=json.dumps(body.model_kwargs) if body.model_kwargs else "",
                               request_id=body.request_id, timeout_s=body.timeout_s)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


_NUMPY = {"BOOL": "?", "UINT8": "u1", "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2",
          "FP32": "<f4", "FP64": "<f8"}


def tensor_values(t: tensor_pb2.Tensor) -> list | None:
    """The elements as nested JSON lists (an action chunk is small, and a robot client reads numbers);
    None for a datatype JSON numbers cannot hold exactly (BF16)."""
    dtype = _NUMPY.get(t.datatype)
    if dtype is None:
        return None
    try:
        return np.frombuffer(t.raw, dtype=dtype).reshape(list(t.shape)).tolist()
    except ValueError as e:
        raise ProtocolError(f"tensor '{t.name}': {len(t.raw)} bytes do not make {t.datatype} {list(t.shape)}: {e}") from None


def tensor_json(t: tensor_pb2.Tensor, values: bool = False) -> dict:
    """``values``: also the elements as JSON numbers (ACTION chunks)."""
    if t.WhichOneof("payload") == "shm":
        raise ProtocolError(f"tensor '{t.name}' arrived by shared-memory reference; the public API carries bytes inline")
    out = {"datatype": t.datatype, "shape": list(t.shape), "data_b64": b64(t.raw)}
    if values and (v := tensor_values(t)) is not None:
        out["values"] = v
    return out


def chunk_json(c: cpb.OutputChunk) -> dict:
    """One NDJSON line; the payload keys depend on the modality."""
    modality = MODALITY.get(c.modality, "unspecified")
    out: dict = {"type": "chunk", "name": c.name, "modality": modality, "index": c.index}
    if modality == "text" or c.text:
        out["text"] = c.text
    if modality in _BYTES or c.data:
        out["data_b64"] = b64(c.data)
        out["mime_type"] = c.mime_type
    if modality == "audio" or c.sample_rate_hz:
        out["sample_rate_hz"] = c.sample_rate_hz
    if modality in _TENSORS or c.HasField("tensor"):
        out["tensor"] = tensor_json(c.tensor, values=modality == "action")
    out["token_ids"] = list(c.token_ids)
    out["elapsed_s"] = c.elapsed_s
    return out


# -- NDJSON lines of /generate, built as text: the per-chunk path -------------------------------
# The same bytes as json.dumps(chunk_json(c), separators=(",", ":")) (tests/gateway/test_ndjson_lines.py
# checks it), at a fraction of the cost: no dict per chunk, and the base64 payloads, which need no
# escaping, are not scanned for characters to escape.
def _float(x: float) -> str:
    r = float.__repr__(x)
    return r if r[-1].isdigit() else json.dumps(x)  # NaN / Infinity, as json writes them


def _ints(xs) -> str:
    n = len(xs)
    return f"[{xs[0]}]" if n == 1 else f"[{','.join(map(str, xs))}]" if n else "[]"


def _b64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def chunk_line(c: cpb.OutputChunk) -> str:
    """``chunk_json(c)`` as compact JSON text (no newline)."""
    modality = MODALITY.get(c.modality, "unspecified")
    s = f'{{"type":"chunk","name":{encode_basestring_ascii(c.name)},"modality":"{modality}","index":{c.index}'
    text = c.text
    if modality == "text" or text:
        s += f',"text":{encode_basestring_ascii(text)}'
    data = c.data
    if modality in _BYTES or data:
        s += f',"data_b64":"{_b64(data)}","mime_type":{encode_basestring_ascii(c.mime_type)}'
    rate = c.sample_rate_hz
    if modality == "audio" or rate:
        s += f',"sample_rate_hz":{rate}'
    if modality in _TENSORS or c.HasField("tensor"):
        t = c.tensor
        if t.WhichOneof("payload") == "shm":
            tensor_json(t)  # raises ProtocolError
        s += (f',"tensor":{{"datatype":{encode_basestring_ascii(t.datatype)},"shape":{_ints(t.shape)},'
              f'"data_b64":"{_b64(t.raw)}"')
        values = tensor_values(t) if modality == "action" else None
        s += "}" if values is None else f',"values":{json.dumps(values, separators=(",", ":"))}}}'
    return f'{s},"token_ids":{_ints(c.token_ids)},"elapsed_s":{_float(c.elapsed_s)}}}'


def message_lines(r: cpb.GenerateResponse) -> bytes:
    """The NDJSON lines of one conductor message: its chunks in order, then the final event if set."""
    lines = [chunk_line(c) for c in r.chunks]
    if r.HasField("final"):
        lines.append(json.dumps(final_json(r.final, r.request_id), separators=(",", ":")))
    lines.append("")
    return "\n".join(lines).encode()


def usage_json(u: cpb.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "walks": u.walks,
            "audio_seconds": u.audio_seconds}


def timings_json(t: cpb.Timings) -> dict:
    return {"first_output_s": t.first_output_s, "total_s": t.total_s, "process_prompt_s": t.process_prompt_s}


def final_json(f: cpb.FinalEvent, request_id: str) -> dict:
    return {"type": "final", "request_id": request_id, "usage": usage_json(f.usage), "timings": timings_json(f.timings),
            "finish_reason": f.finish_reason}


def error_json(code: str, message: str) -> dict:
    return {"type": "error", "error": {"code": code, "message": message}}


class Collected:
    """A whole request's chunks folded into one object per output name (``stream: false``):
    text concatenated, image/audio bytes concatenated, tensors listed in order."""

    def __init__(self) -> None:
        self.outputs: dict[str, dict] = {}
        self._text: dict[str, list[str]] = {}
        self._bytes: dict[str, bytearray] = {}

    def add(self, c: cpb.OutputChunk) -> None:
        out = self.outputs.get(c.name)
        if out is None:
            out = self.outputs[c.name] = self._start(c)
        out["num_chunks"] += 1
        out["token_ids"].extend(c.token_ids)
        if c.name in self._bytes:
            self._bytes[c.name] += c.data
        elif "chunks" in out:
            out["chunks"].append(tensor_json(c.tensor, values=out["modality"] == "action"))
        else:
            self._text[c.name].append(c.text)

    def _start(self, c: cpb.OutputChunk) -> dict:
        modality = MODALITY.get(c.modality, "unspecified")
        out: dict = {"modality": modality, "num_chunks": 0, "token_ids": []}
        if modality in _BYTES:
            out["mime_type"] = c.mime_type
            self._bytes[c.name] = bytearray()
        elif modality in _TENSORS or c.HasField("tensor"):
            out["chunks"] = []
        else:
            self._text[c.name] = []
        if modality == "audio":
            out["sample_rate_hz"] = c.sample_rate_hz
        return out

    def json(self, request_id: str, final: cpb.FinalEvent) -> dict:
        outputs = {}
        for name, out in self.outputs.items():
            if name in self._bytes:
                out = {**out, "data_b64": b64(self._bytes[name])}
            elif name in self._text:
                out = {**out, "text": "".join(self._text[name])}
            outputs[name] = out
        return {"request_id": request_id, "outputs": outputs, "usage": usage_json(final.usage),
                "timings": timings_json(final.timings), "finish_reason": final.finish_reason}
