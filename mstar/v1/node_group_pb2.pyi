from mstar.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FrameKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAME_KIND_UNSPECIFIED: _ClassVar[FrameKind]
    FRAME_KIND_DATA: _ClassVar[FrameKind]
    FRAME_KIND_START_WALK: _ClassVar[FrameKind]
    FRAME_KIND_LOOP_END: _ClassVar[FrameKind]
    FRAME_KIND_RELEASE: _ClassVar[FrameKind]
    FRAME_KIND_EMIT: _ClassVar[FrameKind]
    FRAME_KIND_FRAGMENT_DONE: _ClassVar[FrameKind]
    FRAME_KIND_FAIL: _ClassVar[FrameKind]
    FRAME_KIND_STREAM_TAKEN: _ClassVar[FrameKind]
FRAME_KIND_UNSPECIFIED: FrameKind
FRAME_KIND_DATA: FrameKind
FRAME_KIND_START_WALK: FrameKind
FRAME_KIND_LOOP_END: FrameKind
FRAME_KIND_RELEASE: FrameKind
FRAME_KIND_EMIT: FrameKind
FRAME_KIND_FRAGMENT_DONE: FrameKind
FRAME_KIND_FAIL: FrameKind
FRAME_KIND_STREAM_TAKEN: FrameKind

class FrameError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("kind", "request_id", "walk", "walk_seq", "node", "edge", "iteration", "chunk_index", "done", "tensors", "error", "parent_walk_seq", "request_kwargs_json", "persisted_sent", "persisted_expected", "routes")
    class PersistedSentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RoutesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WALK_FIELD_NUMBER: _ClassVar[int]
    WALK_SEQ_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    EDGE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PARENT_WALK_SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_SENT_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    kind: FrameKind
    request_id: str
    walk: str
    walk_seq: int
    node: str
    edge: str
    iteration: int
    chunk_index: int
    done: bool
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    error: FrameError
    parent_walk_seq: int
    request_kwargs_json: str
    persisted_sent: _containers.ScalarMap[str, int]
    persisted_expected: int
    routes: _containers.ScalarMap[str, str]
    def __init__(self, kind: _Optional[_Union[FrameKind, str]] = ..., request_id: _Optional[str] = ..., walk: _Optional[str] = ..., walk_seq: _Optional[int] = ..., node: _Optional[str] = ..., edge: _Optional[str] = ..., iteration: _Optional[int] = ..., chunk_index: _Optional[int] = ..., done: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., error: _Optional[_Union[FrameError, _Mapping]] = ..., parent_walk_seq: _Optional[int] = ..., request_kwargs_json: _Optional[str] = ..., persisted_sent: _Optional[_Mapping[str, int]] = ..., persisted_expected: _Optional[int] = ..., routes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class FrameBatch(_message.Message):
    __slots__ = ("sender", "frames")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    sender: str
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    def __init__(self, sender: _Optional[str] = ..., frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ...) -> None: ...

class Location(_message.Message):
    __slots__ = ("service", "host_id", "process", "gpu_uuids", "mooncake_session", "mooncake_protocol")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_SESSION_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    service: str
    host_id: str
    process: str
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    mooncake_session: str
    mooncake_protocol: str
    def __init__(self, service: _Optional[str] = ..., host_id: _Optional[str] = ..., process: _Optional[str] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., mooncake_session: _Optional[str] = ..., mooncake_protocol: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("released_buffer_ids", "receiver")
    RELEASED_BUFFER_IDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    released_buffer_ids: _containers.RepeatedScalarFieldContainer[int]
    receiver: Location
    def __init__(self, released_buffer_ids: _Optional[_Iterable[int]] = ..., receiver: _Optional[_Union[Location, _Mapping]] = ...) -> None: ...
