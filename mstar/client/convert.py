"""The SDK's one conversion module: protobuf (gRPC) and gateway JSON (REST) into its dataclasses."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from mstar.client.errors import Internal, make_error
from mstar.client.types import Chunk, Final, GenerateParams, Modality, ModelInfo, Tensor, Timings, Usage
from mstar.v1 import conductor_pb2 as cpb

_MODALITY = {cpb.MODALITY_UNSPECIFIED: Modality.UNSPECIFIED, cpb.MODALITY_TEXT: Modality.TEXT,
             cpb.MODALITY_IMAGE: Modality.IMAGE, cpb.MODALITY_AUDIO: Modality.AUDIO,
             cpb.MODALITY_ACTION: Modality.ACTION, cpb.MODALITY_LATENT: Modality.LATENT}


@dataclass(frozen=True)
class Message:
    """What a transport yields: chunks in order, and the final event on the last message."""

    request_id: str
    chunks: tuple[Chunk, ...] = ()
    final: Final | None = None


# --- gRPC ---------------------------------------------------------------------------------------

def to_proto(p: GenerateParams) -> cpb.GenerateRequest:
    files = [cpb.InputFile(name=f.name, content_type=f.content_type, data=f.data) for f in p.files]
    return cpb.GenerateRequest(model=p.model, text=p.text, files=files,
                               model_kwargs_json=json.dumps(p.model_kwargs) if p.model_kwargs else "",
                               request_id=p.request_id, timeout_s=p.timeout_s)


def chunk_from_proto(c: cpb.OutputChunk) -> Chunk:
    tensor = None
    if c.HasField("tensor"):
        if c.tensor.WhichOneof("payload") == "shm":
            raise Internal(f"tensor '{c.tensor.name}' arrived by shared-memory reference; the public API carries bytes inline")
        tensor = Tensor(c.tensor.datatype, tuple(c.tensor.shape), c.tensor.raw)
    return Chunk(c.name, _MODALITY.get(c.modality, Modality.UNSPECIFIED), c.index, c.text, c.data, c.mime_type,
                 c.sample_rate_hz, tensor, tuple(c.token_ids), c.elapsed_s)


def message_from_proto(r: cpb.GenerateResponse) -> Message:
    final = None
    if r.HasField("final"):
        u, t = r.final.usage, r.final.timings
        final = Final(r.request_id, Usage(u.prompt_tokens, u.completion_tokens, u.walks, u.audio_seconds),
                      Timings(t.first_output_s, t.total_s, t.process_prompt_s), r.final.finish_reason)
    return Message(r.request_id, tuple(chunk_from_proto(c) for c in r.chunks), final)


def model_from_proto(m: cpb.ModelInfo) -> ModelInfo:
    return ModelInfo.parse(m.name, m.walks, m.outputs, m.node_groups)


# --- REST (the gateway's NDJSON lines, /v1/models) ----------------------------------------------

def rest_body(p: GenerateParams) -> dict:
    """The JSON fields of ``POST /generate`` (always streamed: the SDK folds results itself)."""
    body: dict = {"model": p.model, "text": p.text, "stream": True}
    if p.model_kwargs:
        body["model_kwargs"] = p.model_kwargs
    if p.timeout_s:
        body["timeout_s"] = p.timeout_s
    if p.request_id:
        body["request_id"] = p.request_id
    return body


def _b64(value: object) -> bytes:
    return base64.b64decode(value) if isinstance(value, str) else b""


def message_from_line(line: bytes | str, request_id: str) -> Message:
    """One NDJSON line of ``POST /generate``; an error line raises its typed error."""
    try:
        obj = json.loads(line)
        kind = obj["type"]
        if kind == "chunk":
            t = obj.get("tensor")
            tensor = Tensor(t["datatype"], tuple(t["shape"]), _b64(t["data_b64"])) if t else None
            chunk = Chunk(obj["name"], Modality(obj["modality"]), obj["index"], obj.get("text", ""),
                          _b64(obj.get("data_b64")), obj.get("mime_type", ""), obj.get("sample_rate_hz", 0), tensor,
                          tuple(obj.get("token_ids", ())), obj.get("elapsed_s", 0.0))
            return Message(request_id, (chunk,))
        if kind == "final":
            u, t = obj["usage"], obj["timings"]
            rid = obj.get("request_id") or request_id
            final = Final(rid, Usage(u["prompt_tokens"], u["completion_tokens"], u["walks"], u["audio_seconds"]),
                          Timings(t["first_output_s"], t["total_s"], t["process_prompt_s"]), obj["finish_reason"])
            return Message(rid, (), final)
        if kind == "error":
            err = obj["error"]
            raise make_error(err["code"], err["message"], request_id=request_id)
    except (ValueError, KeyError, TypeError) as e:
        raise Internal(f"unreadable line from the gateway ({e}): {line[:200]!r}", request_id=request_id) from None
    raise Internal(f"unknown line type '{kind}' from the gateway", request_id=request_id)


def model_from_json(m: dict) -> ModelInfo:
    return ModelInfo.parse(m["id"], m.get("walks", ()), m.get("outputs", ()), m.get("node_groups", ()))
