"""Conductor-side conversions between the model's dataclasses and the public protobufs."""

from __future__ import annotations

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from mstar import untrusted, wire
from mstar.models.base import InputFile, InvalidArgument, Output, Prompt
from mstar.v1 import conductor_pb2 as cpb

MODALITY = {1: cpb.MODALITY_TEXT, 2: cpb.MODALITY_IMAGE, 3: cpb.MODALITY_AUDIO, 4: cpb.MODALITY_ACTION, 5: cpb.MODALITY_LATENT}


def invalid_argument_status(field: str, message: str) -> grpc.Status:
    detail = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=field, description=message)])
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=f"{field}: {message}")
    status.details.add().Pack(detail)
    return rpc_status.to_status(status)


def prompt_from_request(req: cpb.GenerateRequest) -> Prompt:
    kwargs: dict = {}
    if req.model_kwargs_json:
        try:
            loaded = untrusted.loads(req.model_kwargs_json)
        except untrusted.Untrusted as e:
            raise InvalidArgument(f"model_kwargs.{e.path}" if e.path else "model_kwargs_json", str(e)) from None
        if not isinstance(loaded, dict):
            raise InvalidArgument("model_kwargs_json", "must be a JSON object")
        kwargs = loaded
    files = [InputFile(f.name, f.content_type, f.data) for f in req.files]
    return Prompt(req.text, files, kwargs)


def fill_chunk(chunk: cpb.OutputChunk, out: Output, index: int, elapsed_s: float) -> None:
    """Write ``out`` into ``chunk`` (in place, e.g. a new element of a response's chunks:
    no message copy); fields at their default stay unset, which proto3 sends the same way."""
    chunk.name = out.name
    chunk.modality = MODALITY[out.modality.value]
    chunk.index = index
    chunk.elapsed_s = elapsed_s
    if out.text:
        chunk.text = out.text
    if out.data:
        chunk.data = out.data
    if out.mime_type:
        chunk.mime_type = out.mime_type
    if out.sample_rate_hz:
        chunk.sample_rate_hz = out.sample_rate_hz
    if out.token_ids:
        chunk.token_ids.extend(out.token_ids)
    if out.tensor is not None:
        wire.fill_proto(chunk.tensor, out.name, out.tensor)


def output_to_proto(out: Output, index: int, elapsed_s: float) -> cpb.OutputChunk:
    chunk = cpb.OutputChunk()
    fill_chunk(chunk, out, index, elapsed_s)
    return chunk
