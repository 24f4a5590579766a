from mstar.v1 import node_group_pb2 as _node_group_pb2
from mstar.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    def __init__(self, name: _Optional[str] = ..., content_type: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

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
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., files: _Optional[_Iterable[_Union[InputFile, _Mapping]]] = ..., model_kwargs_json: _Optional[str] = ..., request_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

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
    def __init__(self, name: _Optional[str] = ..., modality: _Optional[_Union[Modality, str]] = ..., text: _Optional[str] = ..., data: _Optional[bytes] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., mime_type: _Optional[str] = ..., sample_rate_hz: _Optional[int] = ..., index: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

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
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., walks: _Optional[int] = ..., audio_seconds: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("first_output_s", "total_s", "process_prompt_s")
    FIRST_OUTPUT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    PROCESS_PROMPT_S_FIELD_NUMBER: _ClassVar[int]
    first_output_s: float
    total_s: float
    process_prompt_s: float
    def __init__(self, first_output_s: _Optional[float] = ..., total_s: _Optional[float] = ..., process_prompt_s: _Optional[float] = ...) -> None: ...

class FinalEvent(_message.Message):
    __slots__ = ("usage", "timings", "finish_reason")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    timings: Timings
    finish_reason: str
    def __init__(self, usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunks", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunks: _containers.RepeatedCompositeFieldContainer[OutputChunk]
    final: FinalEvent
    def __init__(self, request_id: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[OutputChunk, _Mapping]]] = ..., final: _Optional[_Union[FinalEvent, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "walks", "outputs", "node_groups", "api")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WALKS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    NODE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    name: str
    walks: _containers.RepeatedScalarFieldContainer[str]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    node_groups: _containers.RepeatedScalarFieldContainer[str]
    api: ModelApi
    def __init__(self, name: _Optional[str] = ..., walks: _Optional[_Iterable[str]] = ..., outputs: _Optional[_Iterable[str]] = ..., node_groups: _Optional[_Iterable[str]] = ..., api: _Optional[_Union[ModelApi, _Mapping]] = ...) -> None: ...

class ModelApi(_message.Message):
    __slots__ = ("chat_media", "chat_kwargs_json", "chat_audio_output", "voices", "default_voice", "audio_formats", "edit_kwargs_json", "speech_kwargs_json")
    CHAT_MEDIA_FIELD_NUMBER: _ClassVar[int]
    CHAT_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_AUDIO_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    VOICES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VOICE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FORMATS_FIELD_NUMBER: _ClassVar[int]
    EDIT_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    SPEECH_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    chat_media: _containers.RepeatedScalarFieldContainer[str]
    chat_kwargs_json: str
    chat_audio_output: str
    voices: _containers.RepeatedScalarFieldContainer[str]
    default_voice: str
    audio_formats: _containers.RepeatedScalarFieldContainer[str]
    edit_kwargs_json: str
    speech_kwargs_json: str
    def __init__(self, chat_media: _Optional[_Iterable[str]] = ..., chat_kwargs_json: _Optional[str] = ..., chat_audio_output: _Optional[str] = ..., voices: _Optional[_Iterable[str]] = ..., default_voice: _Optional[str] = ..., audio_formats: _Optional[_Iterable[str]] = ..., edit_kwargs_json: _Optional[str] = ..., speech_kwargs_json: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class CameraImage(_message.Message):
    __slots__ = ("name", "data", "mime_type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    mime_type: str
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class ActRequest(_message.Message):
    __slots__ = ("model", "task", "images", "state", "seed", "request_id", "timeout_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    task: str
    images: _containers.RepeatedCompositeFieldContainer[CameraImage]
    state: _containers.RepeatedScalarFieldContainer[float]
    seed: int
    request_id: str
    timeout_s: float
    def __init__(self, model: _Optional[str] = ..., task: _Optional[str] = ..., images: _Optional[_Iterable[_Union[CameraImage, _Mapping]]] = ..., state: _Optional[_Iterable[float]] = ..., seed: _Optional[int] = ..., request_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ActResponse(_message.Message):
    __slots__ = ("request_id", "actions", "usage", "timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    actions: _tensor_pb2.Tensor
    usage: Usage
    timings: Timings
    def __init__(self, request_id: _Optional[str] = ..., actions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("group", "address", "leave")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    group: str
    address: str
    leave: bool
    def __init__(self, group: _Optional[str] = ..., address: _Optional[str] = ..., leave: _Optional[bool] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replicas: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckRouteRequest(_message.Message):
    __slots__ = ("group", "address")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    group: str
    address: str
    def __init__(self, group: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class CheckRouteResponse(_message.Message):
    __slots__ = ("announced",)
    ANNOUNCED_FIELD_NUMBER: _ClassVar[int]
    announced: bool
    def __init__(self, announced: _Optional[bool] = ...) -> None: ...
