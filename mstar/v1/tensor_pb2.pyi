from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., buffer_id: _Optional[int] = ...) -> None: ...

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
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., raw: _Optional[bytes] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...
