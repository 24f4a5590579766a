"""Binary answers of ``POST /generate``, chosen by the ``Accept`` header (the first of the types the
gateway serves that it lists; JSON when it lists none):

- ``application/octet-stream``: one tensor output as raw little-endian row-major bytes, its
  ``X-Tensor-Name`` / ``X-Tensor-Datatype`` / ``X-Tensor-Shape`` (comma-separated) in the headers.
  The body field ``output`` names it where the result has several (a rollout's frames and poses);
  an output sent in several chunks is concatenated along dim 0. Not with ``stream: true``.
- ``multipart/mixed``: every output chunk as one part as it is produced (streamed), a tensor's bytes
  raw with the same headers, then the final event (or an error) as an ``application/json`` part.
  Each part says ``X-Chunk-Name``, ``X-Chunk-Index``, ``X-Chunk-Modality`` and ``Content-Length``.
"""

from __future__ import annotations

import json
import uuid

import grpc
from aiohttp import web

from mstar.gateway.convert import MODALITY, error_json, final_json
from mstar.gateway.errors import ApiError, bad_request
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import tensor_pb2

OCTET, MULTIPART = "application/octet-stream", "multipart/mixed"
SERVED = ("application/json", "application/x-ndjson", OCTET, MULTIPART)
_ITEMSIZE = {"BOOL": 1, "UINT8": 1, "INT8": 1, "INT16": 2, "INT32": 4, "INT64": 8, "FP16": 2, "BF16": 2, "FP32": 4,
             "FP64": 8}


def accepted(accept: str | None) -> str | None:
    """The binary type the client asked for, or None (JSON / NDJSON)."""
    for item in (accept or "").split(","):
        media = item.split(";", 1)[0].strip().lower()
        if media in SERVED:
            return media if media in (OCTET, MULTIPART) else None
    return None


def tensor_headers(t: tensor_pb2.Tensor) -> dict[str, str]:
    return {"X-Tensor-Name": t.name, "X-Tensor-Datatype": t.datatype, "X-Tensor-Shape": ",".join(map(str, t.shape))}


def check_output(info: cpb.ModelInfo, output: str) -> None:
    """Before running: ``output`` must be one of the model's tensor outputs."""
    tensors = [o.rpartition(":")[0] for o in info.outputs if o.rpartition(":")[2] in ("action", "latent")]
    if output not in tensors:
        raise bad_request("output", f"output: model '{info.name}' has no tensor output '{output}'; its tensor outputs: "
                                    f"{', '.join(tensors) or 'none'}")


def one_tensor(chunks: dict[str, list[tensor_pb2.Tensor]], output: str) -> tensor_pb2.Tensor:
    """The tensor ``output`` (or the result's only one), its chunks joined along dim 0."""
    if output and output not in chunks:
        raise bad_request("output", f"output: this request produced no '{output}'; it produced "
                                    f"{', '.join(chunks) or 'no tensors'}")
    if not output:
        if len(chunks) != 1:
            raise bad_request("output", f"output: the result has {len(chunks)} tensor outputs "
                                        f"({', '.join(chunks) or 'none'}); name one in 'output', or send "
                                        f"Accept: {MULTIPART} for all of them")
        output = next(iter(chunks))
    parts = chunks[output]
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(p.datatype != first.datatype or list(p.shape[1:]) != list(first.shape[1:]) or not p.shape for p in parts):
        raise ApiError(406, f"output '{output}' came in chunks of different shapes; read it as {MULTIPART} or JSON",
                       code="NOT_ACCEPTABLE", field="output")
    rows = sum(p.shape[0] for p in parts)
    return tensor_pb2.Tensor(name=first.name or output, datatype=first.datatype, shape=[rows, *first.shape[1:]],
                             raw=b"".join(p.raw for p in parts))


async def octet_response(call, first: cpb.GenerateResponse, output: str, next_message, settle) -> web.Response:
    """Read the whole request and answer one tensor's bytes."""
    chunks: dict[str, list[tensor_pb2.Tensor]] = {}
    msg = first
    while True:
        if msg is None:
            raise ApiError(500, "conductor ended the stream without a final event", code="INTERNAL")
        for c in msg.chunks:
            if c.HasField("tensor"):
                if c.tensor.WhichOneof("payload") != "raw":
                    raise ApiError(500, f"tensor '{c.name}' arrived by reference; the public API carries bytes inline",
                                   code="INTERNAL")
                chunks.setdefault(c.name, []).append(c.tensor)
        if msg.HasField("final"):
            break
        msg = await next_message(call)
    await settle(call)
    t = one_tensor(chunks, output)
    expected = _ITEMSIZE.get(t.datatype, 0)
    n = 1
    for d in t.shape:
        n *= d
    if expected and len(t.raw) != n * expected:
        raise ApiError(500, f"tensor '{t.name}' holds {len(t.raw)} bytes, not {n} x {t.datatype}", code="INTERNAL")
    return web.Response(body=t.raw, content_type=OCTET, headers={"X-Request-Id": msg.request_id, **tensor_headers(t)})


def _part(boundary: str, headers: dict[str, str], body: bytes) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"--{boundary}\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body + b"\r\n"


def chunk_part(boundary: str, c: cpb.OutputChunk) -> bytes:
    modality = MODALITY.get(c.modality, "unspecified")
    headers = {"X-Chunk-Name": c.name, "X-Chunk-Index": str(c.index), "X-Chunk-Modality": modality,
               "X-Elapsed-S": repr(c.elapsed_s)}
    if c.token_ids:
        headers["X-Token-Ids"] = ",".join(map(str, c.token_ids))
    if c.HasField("tensor"):
        if c.tensor.WhichOneof("payload") != "raw":
            raise ValueError(f"tensor '{c.name}' arrived by reference; the public API carries bytes inline")
        return _part(boundary, {"Content-Type": OCTET, **headers, **tensor_headers(c.tensor)}, c.tensor.raw)
    if c.data:
        if c.sample_rate_hz:
            headers["X-Sample-Rate-Hz"] = str(c.sample_rate_hz)
        return _part(boundary, {"Content-Type": c.mime_type or OCTET, **headers}, c.data)
    return _part(boundary, {"Content-Type": "text/plain; charset=utf-8", **headers}, c.text.encode())


def _json_part(boundary: str, name: str, obj: dict) -> bytes:
    return _part(boundary, {"Content-Type": "application/json", "X-Chunk-Name": name}, json.dumps(obj).encode())


async def multipart_stream(request: web.Request, call, first: cpb.GenerateResponse, next_message,
                           settle) -> web.StreamResponse:
    boundary = uuid.uuid4().hex
    resp = web.StreamResponse(headers={"X-Request-Id": first.request_id, "Cache-Control": "no-cache",
                                       "Content-Type": f"{MULTIPART}; boundary={boundary}"})
    await resp.prepare(request)
    msg = first
    try:
        while True:
            if msg is None:
                await resp.write(_json_part(boundary, "error", error_json(
                    "INTERNAL", "conductor ended the stream without a final event")))
                break
            try:
                await resp.write(b"".join(chunk_part(boundary, c) for c in msg.chunks))
            except ValueError as e:
                await resp.write(_json_part(boundary, "error", error_json("INTERNAL", str(e))))
                break
            if msg.HasField("final"):
                await resp.write(_json_part(boundary, "final", final_json(msg.final, msg.request_id)))
                await settle(call)
                break
            try:
                msg = await next_message(call)
            except grpc.aio.AioRpcError as e:
                await resp.write(_json_part(boundary, "error", error_json(e.code().name, e.details() or e.code().name)))
                break
        await resp.write(f"--{boundary}--\r\n".encode())
        await resp.write_eof()
    except ConnectionResetError:  # the client went away; generate()'s finally cancels the call
        pass
    return resp
