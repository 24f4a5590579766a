from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class SharedMemoryRef(_message.Message):
    __slots__ = ("segment", "offset", "nbytes", "buffer_id")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    nbytes: int
    buffer_id: int
    def __init__(self, segment: str | None = ..., offset: int | None = ..., nbytes: int | None = ..., buffer_id: int | None = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "datatype", "shape", "raw", "shm")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw: bytes
    shm: SharedMemoryRef
    def __init__(self, name: str | None = ..., datatype: str | None = ..., shape: _Iterable[int] | None = ..., raw: bytes | None = ..., shm: SharedMemoryRef | _Mapping | None = ...) -> None: ...
