from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

from mstar.v1 import tensor_pb2 as _tensor_pb2

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_TEXT: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]
    MODALITY_ACTION: _ClassVar[Modality]
    MODALITY_LATENT: _ClassVar[Modality]
MODALITY_UNSPECIFIED: Modality
MODALITY_TEXT: Modality
MODALITY_IMAGE: Modality
MODALITY_AUDIO: Modality
MODALITY_ACTION: Modality
MODALITY_LATENT: Modality

class InputFile(_message.Message):
    __slots__ = ("name", "content_type", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    content_type: str
    data: bytes
    def __init__(self, name: str | None = ..., content_type: str | None = ..., data: bytes | None = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "text", "files", "model_kwargs_json", "request_id", "timeout_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    MODEL_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    files: _containers.RepeatedCompositeFieldContainer[InputFile]
    model_kwargs_json: str
    request_id: str
    timeout_s: float
    def __init__(self, model: str | None = ..., text: str | None = ..., files: _Iterable[InputFile | _Mapping] | None = ..., model_kwargs_json: str | None = ..., request_id: str | None = ..., timeout_s: float | None = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("name", "modality", "text", "data", "tensor", "mime_type", "sample_rate_hz", "index", "elapsed_s", "token_ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    modality: Modality
    text: str
    data: bytes
    tensor: _tensor_pb2.Tensor
    mime_type: str
    sample_rate_hz: int
    index: int
    elapsed_s: float
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: str | None = ..., modality: Modality | str | None = ..., text: str | None = ..., data: bytes | None = ..., tensor: _tensor_pb2.Tensor | _Mapping | None = ..., mime_type: str | None = ..., sample_rate_hz: int | None = ..., index: int | None = ..., elapsed_s: float | None = ..., token_ids: _Iterable[int] | None = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "walks", "audio_seconds")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WALKS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    walks: int
    audio_seconds: float
    def __init__(self, prompt_tokens: int | None = ..., completion_tokens: int | None = ..., walks: int | None = ..., audio_seconds: float | None = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("first_output_s", "total_s", "process_prompt_s")
    FIRST_OUTPUT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    PROCESS_PROMPT_S_FIELD_NUMBER: _ClassVar[int]
    first_output_s: float
    total_s: float
    process_prompt_s: float
    def __init__(self, first_output_s: float | None = ..., total_s: float | None = ..., process_prompt_s: float | None = ...) -> None: ...

class FinalEvent(_message.Message):
    __slots__ = ("usage", "timings", "finish_reason")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    timings: Timings
    finish_reason: str
    def __init__(self, usage: Usage | _Mapping | None = ..., timings: Timings | _Mapping | None = ..., finish_reason: str | None = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: OutputChunk
    final: FinalEvent
    def __init__(self, request_id: str | None = ..., chunk: OutputChunk | _Mapping | None = ..., final: FinalEvent | _Mapping | None = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: str | None = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: bool | None = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "walks", "outputs", "node_groups")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WALKS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    NODE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    walks: _containers.RepeatedScalarFieldContainer[str]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    node_groups: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: str | None = ..., walks: _Iterable[str] | None = ..., outputs: _Iterable[str] | None = ..., node_groups: _Iterable[str] | None = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Iterable[ModelInfo | _Mapping] | None = ...) -> None: ...
