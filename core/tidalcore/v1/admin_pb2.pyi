from tidalcore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SetQuotaRequest(_message.Message):
    __slots__ = ("session_id", "device_min_bytes", "device_max_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    device_min_bytes: int
    device_max_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., device_min_bytes: _Optional[int] = ..., device_max_bytes: _Optional[int] = ...) -> None: ...

class SetQuotaResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.SessionInfo
    def __init__(self, session: _Optional[_Union[_common_pb2.SessionInfo, _Mapping]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[_common_pb2.SessionInfo, _Mapping]]] = ...) -> None: ...

class EvictSessionRequest(_message.Message):
    __slots__ = ("session_id", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EvictSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.SessionInfo
    def __init__(self, session: _Optional[_Union[_common_pb2.SessionInfo, _Mapping]] = ...) -> None: ...

class PoolStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStatusResponse(_message.Message):
    __slots__ = ("backend", "device", "host", "sessions", "version", "started_unix_ns", "mode", "chunk_bytes", "facts")
    class FactsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FACTS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    device: _common_pb2.PoolUsage
    host: _common_pb2.PoolUsage
    sessions: int
    version: str
    started_unix_ns: int
    mode: str
    chunk_bytes: int
    facts: _containers.ScalarMap[str, str]
    def __init__(self, backend: _Optional[str] = ..., device: _Optional[_Union[_common_pb2.PoolUsage, _Mapping]] = ..., host: _Optional[_Union[_common_pb2.PoolUsage, _Mapping]] = ..., sessions: _Optional[int] = ..., version: _Optional[str] = ..., started_unix_ns: _Optional[int] = ..., mode: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., facts: _Optional[_Mapping[str, str]] = ...) -> None: ...
