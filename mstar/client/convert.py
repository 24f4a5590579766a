"""The SDK's one conversion module: protobuf (gRPC) and gateway JSON (REST) into its dataclasses."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass

from mstar.client.errors import Internal, make_error
from mstar.client.robot import ActParams
from mstar.client.types import (
    Chunk,
    Final,
    GenerateParams,
    Modality,
    ModelApi,
    ModelInfo,
    Tensor,
    Timings,
    Usage,
)
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import tensor_pb2

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


def act_to_proto(p: ActParams) -> cpb.ActRequest:
    images = [cpb.CameraImage(name=f.name, data=f.data, mime_type=f.content_type) for f in p.images]
    return cpb.ActRequest(model=p.model, task=p.task, images=images, state=p.state, seed=p.seed,
                          request_id=p.request_id, timeout_s=p.timeout_s)


def tensor_from_proto(t: tensor_pb2.Tensor) -> Tensor:
    if t.WhichOneof("payload") not in (None, "raw"):
        raise Internal(f"tensor '{t.name}' arrived by reference; the public API carries bytes inline")
    return Tensor(t.datatype, tuple(t.shape), t.raw)


def chunk_from_proto(c: cpb.OutputChunk) -> Chunk:
    tensor = tensor_from_proto(c.tensor) if c.HasField("tensor") else None
    return Chunk(c.name, _MODALITY.get(c.modality, Modality.UNSPECIFIED), c.index, c.text, c.data, c.mime_type,
                 c.sample_rate_hz, tensor, tuple(c.token_ids), c.elapsed_s)


def message_from_proto(r: cpb.GenerateResponse) -> Message:
    final = None
    if r.HasField("final"):
        u, t = r.final.usage, r.final.timings
        final = Final(r.request_id, Usage(u.prompt_tokens, u.completion_tokens, u.walks, u.audio_seconds),
                      Timings(t.first_output_s, t.total_s, t.process_prompt_s), r.final.finish_reason)
    return Message(r.request_id, tuple(chunk_from_proto(c) for c in r.chunks), final)


def _kwargs(raw: str) -> dict:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise Internal(f"the server reported malformed model kwargs in a model's api: {raw[:100]!r}")
    return value


def model_from_proto(m: cpb.ModelInfo) -> ModelInfo:
    a = m.api
    api = ModelApi(tuple(a.chat_media), _kwargs(a.chat_kwargs_json), a.chat_audio_output, tuple(a.voices),
                   a.default_voice, tuple(a.audio_formats), _kwargs(a.edit_kwargs_json) if a.edit_kwargs_json else None)
    return ModelInfo.parse(m.name, m.walks, m.outputs, m.node_groups, api)


# --- REST (the gateway's NDJSON lines, /v1/models) ----------------------------------------------

def rest_body(p: GenerateParams, stream: bool = True) -> dict:
    """The JSON fields of ``POST /generate`` (streamed but for a binary answer: the SDK folds results itself)."""
    body: dict = {"model": p.model, "text": p.text, "stream": stream}
    if p.model_kwargs:
        body["model_kwargs"] = p.model_kwargs
    if p.timeout_s:
        body["timeout_s"] = p.timeout_s
    if p.request_id:
        body["request_id"] = p.request_id
    return body


def act_rest_params(p: ActParams) -> GenerateParams:
    """Act over REST: ``POST /generate`` with the task as text, the cameras as file parts, the state and
    seed as model_kwargs (answered as raw bytes: ``tensor_from_headers``)."""
    return GenerateParams(p.model, p.task, p.images, p.model_kwargs, p.timeout_s, p.request_id)


def tensor_from_headers(headers: Mapping[str, str], body: bytes) -> Tensor:
    """An ``Accept: application/octet-stream`` answer of the gateway: X-Tensor-Datatype / -Shape and the bytes."""
    try:
        shape = tuple(int(d) for d in headers["X-Tensor-Shape"].split(",") if d)
        return Tensor(headers["X-Tensor-Datatype"], shape, body)
    except (KeyError, ValueError) as e:
        raise Internal(f"the gateway's binary answer lacks its tensor headers ({e})") from None


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
    """A ``/v1/models`` entry (its ``api`` carries the chat / edit kwargs: the SDK sends them to /generate itself)."""
    a = m.get("api") or {}
    edit = a.get("edit_kwargs")
    api = ModelApi(tuple(a.get("chat_media", ())), dict(a.get("chat_kwargs") or {}), a.get("chat_audio_output") or "",
                   tuple(a.get("voices", ())), a.get("default_voice") or "", tuple(a.get("audio_formats", ())),
                   dict(edit) if isinstance(edit, dict) else None)
    return ModelInfo.parse(m["id"], m.get("walks", ()), m.get("outputs", ()), m.get("node_groups", ()), api)
