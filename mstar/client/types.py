"""What the SDK hands back: plain dataclasses, the same whichever transport carried them."""

from __future__ import annotations

import io
import mimetypes
import os
import wave
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import numpy as np

_NUMPY_DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
                 "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}


class Modality(StrEnum):
    UNSPECIFIED = "unspecified"
    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"
    ACTION = "action"
    LATENT = "latent"


@dataclass(frozen=True)
class Tensor:
    """A tensor chunk: ``datatype`` (FP32, INT64, ...), ``shape``, raw little-endian row-major ``data``."""

    datatype: str
    shape: tuple[int, ...]
    data: bytes

    def numpy(self) -> np.ndarray:
        """As a numpy array (BF16 has no numpy type: read ``data`` yourself)."""
        try:
            dtype = _NUMPY_DTYPES[self.datatype]
        except KeyError:
            raise ValueError(f"datatype {self.datatype} has no numpy equivalent") from None
        return np.frombuffer(self.data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(self.shape)


@dataclass(frozen=True)
class Chunk:
    """One piece of streamed output (conductor.proto's OutputChunk)."""

    name: str
    modality: Modality
    index: int
    text: str = ""
    data: bytes = b""
    mime_type: str = ""
    #: hertz, for PCM16 audio in ``data``
    sample_rate_hz: int = 0
    tensor: Tensor | None = None
    token_ids: tuple[int, ...] = ()
    #: seconds from the request's arrival at the conductor to this chunk's send
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    walks: int = 0
    audio_seconds: float = 0.0


@dataclass(frozen=True)
class Timings:
    """Seconds from the request's arrival at the conductor."""

    first_output_s: float = 0.0
    total_s: float = 0.0
    process_prompt_s: float = 0.0


@dataclass(frozen=True)
class Final:
    """The last event of a successful request."""

    request_id: str
    usage: Usage
    timings: Timings
    #: "stop" (the model finished) or "length" (a limit was hit)
    finish_reason: str


@dataclass(frozen=True)
class Output:
    """All chunks of one output name, in order."""

    name: str
    modality: Modality
    chunks: tuple[Chunk, ...]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def data(self) -> bytes:
        return b"".join(c.data for c in self.chunks)

    @property
    def tensors(self) -> list[Tensor]:
        return [c.tensor for c in self.chunks if c.tensor is not None]

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]


@dataclass(frozen=True)
class Result:
    """A whole request: every chunk in arrival order and the final event."""

    request_id: str
    chunks: tuple[Chunk, ...]
    final: Final

    @property
    def outputs(self) -> dict[str, Output]:
        by_name: dict[str, list[Chunk]] = {}
        for c in self.chunks:
            by_name.setdefault(c.name, []).append(c)
        return {name: Output(name, cs[0].modality, tuple(cs)) for name, cs in by_name.items()}

    def output(self, name: str) -> Output:
        outputs = self.outputs
        if name not in outputs:
            raise KeyError(f"no output '{name}' in this result; got: {', '.join(outputs) or 'none'}")
        return outputs[name]

    @property
    def text(self) -> str:
        """The ``text`` output, else the first text output, else ''."""
        outputs = self.outputs
        if "text" in outputs:
            return outputs["text"].text
        return next((o.text for o in outputs.values() if o.modality == Modality.TEXT), "")

    @property
    def audio(self) -> Speech | None:
        """The ``audio`` output (else the first audio output) as Speech; None without audio."""
        outputs = self.outputs
        out = outputs.get("audio") if "audio" in outputs and outputs["audio"].modality == Modality.AUDIO else next(
            (o for o in outputs.values() if o.modality == Modality.AUDIO), None)
        return Speech(out, self) if out is not None else None

    @property
    def usage(self) -> Usage:
        return self.final.usage

    @property
    def timings(self) -> Timings:
        return self.final.timings

    @property
    def finish_reason(self) -> str:
        return self.final.finish_reason


def pcm16_wav(pcm: bytes, sample_rate_hz: int) -> bytes:
    """A mono PCM16 WAV file holding ``pcm``."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate_hz)
        w.writeframes(pcm)
    return buf.getvalue()


@dataclass(frozen=True)
class Speech:
    """The audio output of a request (PCM16 little-endian mono) and the request's result."""

    output: Output
    result: Result

    @property
    def pcm(self) -> bytes:
        return self.output.data

    @property
    def sample_rate_hz(self) -> int:
        rates = {c.sample_rate_hz for c in self.output.chunks}
        if len(rates) > 1:
            raise ValueError(f"audio output '{self.output.name}' changes sample rate mid-stream: {sorted(rates)} Hz")
        if not rates or 0 in rates:
            raise ValueError(f"audio output '{self.output.name}' carries no sample rate")
        return rates.pop()

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / 2 / self.sample_rate_hz if self.output.chunks else 0.0

    def wav_bytes(self) -> bytes:
        return pcm16_wav(self.pcm, self.sample_rate_hz)

    def to_wav(self, path: str | os.PathLike) -> Path:
        """Write a mono PCM16 WAV at the chunks' sample rate; returns the path."""
        path = Path(path)
        path.write_bytes(self.wav_bytes())
        return path


@dataclass(frozen=True)
class Image:
    """One image chunk: encoded bytes (``mime_type`` says the format)."""

    data: bytes
    mime_type: str
    index: int

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_bytes(self.data)
        return path


@dataclass(frozen=True)
class ModelApi:
    """What chat may attach and answer with, and whether the model edits images (conductor.proto's ModelApi)."""

    #: media kinds a chat may attach: "image", "audio", "video"
    chat_media: tuple[str, ...] = ()
    #: model kwargs every chat sends (BAGEL: {"mode": "understand"})
    chat_kwargs: dict = field(default_factory=dict)
    #: the audio output of a chat answer with modalities ["text", "audio"] ("": text only)
    chat_audio_output: str = ""
    voices: tuple[str, ...] = ()
    default_voice: str = ""
    audio_formats: tuple[str, ...] = ()
    #: model kwargs an image edit sends; None: the model does not edit images
    edit_kwargs: dict | None = None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    walks: tuple[str, ...]
    #: output name -> modality, in the model's declaration order
    outputs: dict[str, Modality]
    node_groups: tuple[str, ...]
    api: ModelApi = field(default_factory=ModelApi)

    @classmethod
    def parse(cls, name: str, walks: Sequence[str], outputs: Sequence[str], node_groups: Sequence[str],
              api: ModelApi | None = None) -> ModelInfo:
        """``outputs`` as the wire has them: ``"name:modality"``."""
        parsed: dict[str, Modality] = {}
        for entry in outputs:
            out, _, modality = entry.rpartition(":")
            try:
                parsed[out] = Modality(modality)
            except ValueError:
                parsed[out] = Modality.UNSPECIFIED
        return cls(name, tuple(walks), parsed, tuple(node_groups), api or ModelApi())

    def outputs_of(self, modality: Modality) -> list[str]:
        return [n for n, m in self.outputs.items() if m == modality]


@dataclass(frozen=True)
class Health:
    ok: bool
    #: "ok", "unavailable" (the server answers but is not serving) or "unreachable"
    status: str
    reason: str | None = None


@dataclass(frozen=True)
class File:
    """A file attached to a request: ``name`` is the logical name the model reads (e.g. "image")."""

    name: str
    data: bytes
    content_type: str = "application/octet-stream"
    filename: str | None = None


FileLike = str | os.PathLike | bytes | File


def normalize_files(files: Mapping[str, FileLike] | Sequence[File] | None) -> tuple[File, ...]:
    """``{"image": "cat.png"}`` (path, bytes or File by name) or a list of File -> files to send."""
    if files is None:
        return ()
    if isinstance(files, Mapping):
        out = []
        for name, value in files.items():
            if isinstance(value, File):
                out.append(File(name, value.data, value.content_type, value.filename))
            elif isinstance(value, bytes | bytearray):
                out.append(File(name, bytes(value), filename=name))
            else:
                p = Path(value)
                out.append(File(name, p.read_bytes(), mimetypes.guess_type(p.name)[0] or "application/octet-stream",
                                p.name))
        return tuple(out)
    for f in files:
        if not isinstance(f, File):
            raise TypeError(f"files: a sequence must hold File objects, got {type(f).__name__}; "
                            "or pass a mapping of name -> path/bytes/File")
    return tuple(files)


@dataclass(frozen=True)
class GenerateParams:
    """One Generate call, transport-neutral."""

    model: str
    text: str = ""
    files: tuple[File, ...] = ()
    model_kwargs: dict = field(default_factory=dict)
    #: seconds; 0 leaves the server's default in force
    timeout_s: float = 0.0
    request_id: str = ""
