"""What the sync and asyncio clients share: addresses, per-call parameters, stream bookkeeping,
and picking a model's output of a modality."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mstar.client.convert import Message
from mstar.client.errors import Internal, InvalidArgument, NotFound
from mstar.client.messages import prompt_from_messages
from mstar.client.types import (
    Chunk,
    File,
    FileLike,
    Final,
    GenerateParams,
    Image,
    Modality,
    ModelInfo,
    Output,
    Result,
    Speech,
    normalize_files,
)

DEFAULT_TIMEOUT_S = 300.0
#: the API key a client sends when given none (the SDK's one variable, read only here)
API_KEY_ENV = "MSTAR_API_KEY"
#: health() and models() are quick questions: a shorter default wait
QUICK_TIMEOUT_S = 10.0
SCHEMES = ("http://", "https://", "grpc://", "grpcs://")


@dataclass(frozen=True)
class Address:
    #: "rest" (the gateway) or "grpc" (the conductor)
    transport: str
    #: base URL for REST, host:port for gRPC
    target: str
    secure: bool


def parse_address(address: str) -> Address:
    if address.startswith(("http://", "https://")):
        return Address("rest", address.rstrip("/"), address.startswith("https://"))
    if address.startswith(("grpc://", "grpcs://")):
        target = address.split("://", 1)[1].rstrip("/")
        if not target or "/" in target:
            raise ValueError(f"gRPC address must be grpc://host:port, got {address!r}")
        return Address("grpc", target, address.startswith("grpcs://"))
    raise ValueError(f"address must start with one of {', '.join(SCHEMES)} (REST gateway or gRPC conductor), "
                     f"got {address!r}")


def api_key_or_env(api_key: str | None) -> str | None:
    """The key to send as ``Authorization: Bearer <key>``: the given one, else $MSTAR_API_KEY, else none."""
    return api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def make_params(model: str, text: str, *, files: Mapping[str, FileLike] | Sequence[File] | None,
                timeout: float | None, request_id: str | None, model_kwargs: dict | None, kwargs: dict) -> GenerateParams:
    if not isinstance(model, str) or not model:
        raise InvalidArgument("model", "model: must be a non-empty string")
    merged = dict(model_kwargs or {})
    for key, value in kwargs.items():
        if key in merged:
            raise InvalidArgument(f"model_kwargs.{key}", f"model_kwargs.{key}: given both in model_kwargs and as a keyword")
        merged[key] = value
    return GenerateParams(model, text, normalize_files(files), merged, float(timeout or 0.0), request_id or "")


class StreamState:
    """Chunks and final event of one Generate stream, fed message by message."""

    def __init__(self) -> None:
        self.request_id = ""
        self.chunks: list[Chunk] = []
        self.final: Final | None = None

    def take(self, msg: Message | None) -> tuple[Chunk, ...]:
        if msg is None:
            raise Internal("the server ended the stream without a final event", request_id=self.request_id)
        self.request_id = msg.request_id or self.request_id
        self.chunks.extend(msg.chunks)
        if msg.final is not None:
            self.final = msg.final
        return msg.chunks

    def result(self) -> Result:
        assert self.final is not None, "result() before the final event"
        return Result(self.final.request_id or self.request_id, tuple(self.chunks), self.final)


def pick_output(models: list[ModelInfo], model: str, modality: Modality, output: str | None, purpose: str) -> str:
    """The name of ``model``'s output of ``modality``: ``output`` if given, else the one named
    like the modality, else the first. Raises NotFound / InvalidArgument naming the field."""
    info = next((m for m in models if m.name == model), None)
    if info is None:
        raise NotFound(f"model: unknown model '{model}'. Served: {', '.join(m.name for m in models) or 'none'}",
                       field="model")
    names = info.outputs_of(modality)
    described = ", ".join(f"{n}:{m.value}" for n, m in info.outputs.items()) or "none"
    if not names:
        raise InvalidArgument("model", f"model: model '{model}' has no {modality.value} output (its outputs: "
                                       f"{described}); {purpose} needs a model that emits {modality.value}")
    if output is not None:
        if output not in names:
            raise InvalidArgument("output", f"output: model '{model}' has no {modality.value} output named '{output}'; "
                                            f"its {modality.value} outputs: {', '.join(names)}")
        return output
    return modality.value if modality.value in names else names[0]


def split_model(args: tuple, model: str | None, call: str, payload: str) -> tuple[str | None, object]:
    """(model, payload) of a call written either way: ``call(model, payload)`` (explicit) or
    ``call(payload, model=...)`` / ``call(payload)`` (the documented short form)."""
    if len(args) == 2:
        if model is not None:
            raise InvalidArgument("model", f"model: {call}() got the model twice (first argument and model=)")
        return args[0], args[1]
    if len(args) == 1:
        return model, args[0]
    raise TypeError(f"{call}() takes ({payload}) or (model, {payload}); got {len(args)} positional arguments")


def default_model(models: list[ModelInfo], call: str) -> str:
    """The one model the server serves; InvalidArgument (field ``model``) listing them otherwise."""
    if len(models) == 1:
        return models[0].name
    served = ", ".join(m.name for m in models) or "none"
    raise InvalidArgument("model", f"model: the server serves {len(models)} models ({served}); name one: "
                                   f"{call}(..., model=\"{models[0].name if models else 'NAME'}\")")


def chat_prompt(messages: str | Sequence[Mapping]) -> str:
    """A string is a one-user-message chat; a list is OpenAI chat messages (see mstar.client.messages)."""
    return messages if isinstance(messages, str) else prompt_from_messages(messages)


def first_image(images: list[Image], model: str) -> bytes:
    """The simple form of generate_image: the first image's encoded bytes (PNG for M*'s models)."""
    if not images:
        raise Internal(f"model '{model}' finished without an image")
    return images[0].data


def speech_of(result: Result, name: str) -> Speech:
    return Speech(result.outputs.get(name) or Output(name, Modality.AUDIO, ()), result)


def images_of(result: Result, name: str) -> list[Image]:
    out = result.outputs.get(name)
    return [Image(c.data, c.mime_type, c.index) for c in out.chunks] if out else []
