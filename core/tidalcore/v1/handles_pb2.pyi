from tidalcore.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandlesRequest(_message.Message):
    __slots__ = ("version", "device_bytes", "host_bytes", "job_name", "give_back_token", "elastic", "device_min_bytes", "grow_token")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    GIVE_BACK_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROW_TOKEN_FIELD_NUMBER: _ClassVar[int]
    version: int
    device_bytes: int
    host_bytes: int
    job_name: str
    give_back_token: str
    elastic: bool
    device_min_bytes: int
    grow_token: str
    def __init__(self, version: _Optional[int] = ..., device_bytes: _Optional[int] = ..., host_bytes: _Optional[int] = ..., job_name: _Optional[str] = ..., give_back_token: _Optional[str] = ..., elastic: _Optional[bool] = ..., device_min_bytes: _Optional[int] = ..., grow_token: _Optional[str] = ...) -> None: ...

class HandlesResponse(_message.Message):
    __slots__ = ("session_id", "token", "lease", "fd_count", "ipc_handle", "device_floor_chunks", "device_ceiling_chunks", "error_code", "error_message")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    FD_COUNT_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FLOOR_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CEILING_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token: str
    lease: _common_pb2.Lease
    fd_count: int
    ipc_handle: bytes
    device_floor_chunks: int
    device_ceiling_chunks: int
    error_code: str
    error_message: str
    def __init__(self, session_id: _Optional[str] = ..., token: _Optional[str] = ..., lease: _Optional[_Union[_common_pb2.Lease, _Mapping]] = ..., fd_count: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., device_floor_chunks: _Optional[int] = ..., device_ceiling_chunks: _Optional[int] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class FdBatch(_message.Message):
    __slots__ = ("first", "count")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    first: int
    count: int
    def __init__(self, first: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...
