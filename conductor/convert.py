"""Conductor-side conversions between the model's dataclasses and the public protobufs."""

from __future__ import annotations

import json

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from mstar import wire
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
            kwargs = json.loads(req.model_kwargs_json)
        except json.JSONDecodeError as e:
            raise InvalidArgument("model_kwargs_json", f"not valid JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise InvalidArgument("model_kwargs_json", "must be a JSON object")
    if req.timeout_s < 0:
        raise InvalidArgument("timeout_s", "must be >= 0")
    files = [InputFile(f.name, f.content_type, f.data) for f in req.files]
    return Prompt(req.text, files, kwargs)


def output_to_proto(out: Output, index: int, elapsed_s: float) -> cpb.OutputChunk:
    chunk = cpb.OutputChunk(name=out.name, modality=MODALITY[out.modality.value], text=out.text, data=out.data,
                            mime_type=out.mime_type, sample_rate_hz=out.sample_rate_hz, index=index,
                            elapsed_s=elapsed_s, token_ids=out.token_ids)
    if out.tensor is not None:
        chunk.tensor.CopyFrom(wire.to_proto(out.name, out.tensor))
    return chunk
