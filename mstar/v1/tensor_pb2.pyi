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

class MooncakeRef(_message.Message):
    __slots__ = ("session", "address", "nbytes", "buffer_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    session: str
    address: int
    nbytes: int
    buffer_id: int
    def __init__(self, session: _Optional[str] = ..., address: _Optional[int] = ..., nbytes: _Optional[int] = ..., buffer_id: _Optional[int] = ...) -> None: ...

class CudaIpcRef(_message.Message):
    __slots__ = ("handle", "offset", "nbytes", "buffer_id", "device_uuid", "allocation_size")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_SIZE_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    offset: int
    nbytes: int
    buffer_id: int
    device_uuid: str
    allocation_size: int
    def __init__(self, handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., buffer_id: _Optional[int] = ..., device_uuid: _Optional[str] = ..., allocation_size: _Optional[int] = ...) -> None: ...

class LocalRef(_message.Message):
    __slots__ = ("buffer_id", "process")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    buffer_id: int
    process: str
    def __init__(self, buffer_id: _Optional[int] = ..., process: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "datatype", "shape", "raw", "shm", "mooncake", "cuda_ipc", "local")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw: bytes
    shm: SharedMemoryRef
    mooncake: MooncakeRef
    cuda_ipc: CudaIpcRef
    local: LocalRef
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., raw: _Optional[bytes] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ..., mooncake: _Optional[_Union[MooncakeRef, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcRef, _Mapping]] = ..., local: _Optional[_Union[LocalRef, _Mapping]] = ...) -> None: ...
