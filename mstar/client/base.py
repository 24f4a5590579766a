"""What the sync and asyncio clients share: addresses, per-call parameters, stream bookkeeping,
and picking a model's output of a modality."""

from __future__ import annotations

import mimetypes
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mstar.client.convert import Message
from mstar.client.errors import Internal, InvalidArgument, NotFound
from mstar.client.messages import ChatInput, chat_from_messages
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


def model_of(models: list[ModelInfo], model: str) -> ModelInfo:
    info = next((m for m in models if m.name == model), None)
    if info is None:
        raise NotFound(f"model: unknown model '{model}'. Served: {', '.join(m.name for m in models) or 'none'}",
                       field="model")
    return info


#: a media file's content type when neither its bytes nor its name tell
DEFAULT_TYPES = {"image": "image/png", "audio": "audio/wav", "video": "video/mp4"}
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"))


def media_file(kind: str, name: str, value: FileLike) -> File:
    """A chat / edit input (path, bytes or File) as a File named ``name`` whose content type is of ``kind``."""
    if isinstance(value, File):
        ctype = value.content_type if value.content_type.startswith(kind + "/") else DEFAULT_TYPES[kind]
        return File(name, value.data, ctype, value.filename)
    if isinstance(value, bytes | bytearray):
        data = bytes(value)
        ctype = next((m for magic, m in _MAGIC if data.startswith(magic)), None) if kind == "image" else None
        if kind == "image" and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            ctype = "image/webp"
        return File(name, data, ctype or DEFAULT_TYPES[kind], name)
    p = Path(value)
    guessed = mimetypes.guess_type(p.name)[0] or ""
    return File(name, p.read_bytes(), guessed if guessed.startswith(kind + "/") else DEFAULT_TYPES[kind], p.name)


@dataclass(frozen=True)
class ChatCall:
    text: str
    files: tuple[File, ...]
    model_kwargs: dict


def chat_call(info: ModelInfo, messages: str | Sequence[Mapping], media: Mapping[str, Sequence[FileLike] | None],
              modalities: Sequence[str] | None, audio: Mapping[str, str] | None, stream: bool,
              model_kwargs: dict) -> ChatCall:
    """What ``chat()`` sends, by the same rules as the gateway's /v1/chat/completions: the prompt and
    media parts of ``messages`` (a string: one user message) and the ``images`` / ``audios`` /
    ``videos`` keywords as files (kinds the model's api takes), its chat kwargs, and for
    ``modalities=["text", "audio"]`` the kwargs ``modalities`` and ``voice`` (``audio={"voice": ...}``)."""
    chat = ChatInput(messages) if isinstance(messages, str) else chat_from_messages(messages)
    api, model = info.api, info.name
    inputs: list[tuple[str, str, FileLike]] = [(p.kind, p.where, File(p.kind, p.data, p.content_type)) for p in chat.media]
    for arg, kind in (("images", "image"), ("audios", "audio"), ("videos", "video")):
        values = media.get(arg) or ()
        if isinstance(values, str | bytes | bytearray | File) or not isinstance(values, Sequence):
            raise InvalidArgument(arg, f"{arg}: must be a list of paths, bytes or File objects")
        inputs += [(kind, f"{arg}[{i}]", v) for i, v in enumerate(values)]
    files = []
    for i, (kind, where, value) in enumerate(inputs):
        if kind not in api.chat_media:
            raise InvalidArgument(where, f"{where}: model '{model}' takes no {kind} input in chat (it takes: "
                                         f"{', '.join(api.chat_media) or 'text only'})")
        files.append(media_file(kind, f"{kind}{i}", value))
    if not chat.text and not files:
        raise InvalidArgument("messages", "messages: the prompt is empty")
    kwargs = dict(api.chat_kwargs)
    wants = modalities is not None and "audio" in modalities
    if modalities is not None and sorted(modalities) not in (["text"], ["audio", "text"]):
        raise InvalidArgument("modalities", 'modalities: must be ["text"] or ["text", "audio"]')
    if not api.chat_audio_output:
        if wants or audio is not None:
            raise InvalidArgument("modalities" if wants else "audio", f"{'modalities' if wants else 'audio'}: "
                                  f"model '{model}' answers chat in text only")
    else:
        kwargs["modalities"] = ["text", "audio"] if wants else ["text"]
        if audio is not None and not wants:
            raise InvalidArgument("audio", 'audio: only with modalities=["text", "audio"]')
        for key in audio or {}:
            if key not in ("voice", "format"):
                raise InvalidArgument(f"audio.{key}", f"audio.{key}: not supported; audio takes voice and format")
        voice = (audio or {}).get("voice")
        if voice is not None:
            if voice.lower() not in [v.lower() for v in api.voices]:
                raise InvalidArgument("audio.voice", f"audio.voice: model '{model}' has no voice {voice!r}; its voices: "
                                                     f"{', '.join(api.voices) or 'none'}")
            kwargs["voice"] = voice
        fmt = (audio or {}).get("format")
        if fmt is not None and fmt not in api.audio_formats:  # the SDK hands PCM16 and its rate back (Result.audio)
            raise InvalidArgument("audio.format", f"audio.format: use one of {', '.join(api.audio_formats)}")
    for key in kwargs:
        if key in model_kwargs:
            raise InvalidArgument(f"model_kwargs.{key}", f"model_kwargs.{key}: chat sets it itself for model "
                                                         f"'{model}'; leave it out")
    return ChatCall(chat.text, tuple(files), {**model_kwargs, **kwargs})


def edit_kwargs(info: ModelInfo, model_kwargs: dict) -> dict:
    """``model_kwargs`` plus the model's edit kwargs; InvalidArgument naming ``model`` if it edits no images."""
    if info.api.edit_kwargs is None:
        raise InvalidArgument("model", f"model: model '{info.name}' does not edit images")
    for key in info.api.edit_kwargs:
        if key in model_kwargs:
            raise InvalidArgument(f"model_kwargs.{key}", f"model_kwargs.{key}: edit_image sets it itself; leave it out")
    return {**model_kwargs, **info.api.edit_kwargs}


def split_kwargs(kw: dict) -> dict:
    """A call's model kwargs (keywords and ``model_kwargs=``) as one dict, popped from ``kw``."""
    merged = dict(kw.pop("model_kwargs", None) or {})
    for key in [k for k in kw if k not in ("timeout", "request_id", "files", "stream")]:
        if key in merged:
            raise InvalidArgument(f"model_kwargs.{key}", f"model_kwargs.{key}: given both in model_kwargs and as a keyword")
        merged[key] = kw.pop(key)
    return merged


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
