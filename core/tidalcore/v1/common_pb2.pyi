from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolLease(_message.Message):
    __slots__ = ("length", "chunks", "chunk_bytes")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    length: int
    chunks: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: int
    def __init__(self, length: _Optional[int] = ..., chunks: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("device", "host", "backend", "mode", "pci_bus_id")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    device: PoolLease
    host: PoolLease
    backend: str
    mode: str
    pci_bus_id: str
    def __init__(self, device: _Optional[_Union[PoolLease, _Mapping]] = ..., host: _Optional[_Union[PoolLease, _Mapping]] = ..., backend: _Optional[str] = ..., mode: _Optional[str] = ..., pci_bus_id: _Optional[str] = ...) -> None: ...

class PoolUsage(_message.Message):
    __slots__ = ("total_bytes", "leased_bytes", "free_bytes", "used_bytes", "quarantined_bytes")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    leased_bytes: int
    free_bytes: int
    used_bytes: int
    quarantined_bytes: int
    def __init__(self, total_bytes: _Optional[int] = ..., leased_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., quarantined_bytes: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "job_name", "pid", "uid", "lease", "device_used_bytes", "device_peak_bytes", "host_used_bytes", "events_received", "iterations_seen", "attached_unix_ns", "state", "swap_limit_bytes", "swapped_out_bytes", "swapped_in_bytes", "swap_stall_ns", "plan_misses", "live_peak_bytes", "device_floor_bytes", "device_quota_bytes", "device_max_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_SEEN_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SWAP_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_STALL_NS_FIELD_NUMBER: _ClassVar[int]
    PLAN_MISSES_FIELD_NUMBER: _ClassVar[int]
    LIVE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FLOOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    job_name: str
    pid: int
    uid: int
    lease: Lease
    device_used_bytes: int
    device_peak_bytes: int
    host_used_bytes: int
    events_received: int
    iterations_seen: int
    attached_unix_ns: int
    state: str
    swap_limit_bytes: int
    swapped_out_bytes: int
    swapped_in_bytes: int
    swap_stall_ns: int
    plan_misses: int
    live_peak_bytes: int
    device_floor_bytes: int
    device_quota_bytes: int
    device_max_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., job_name: _Optional[str] = ..., pid: _Optional[int] = ..., uid: _Optional[int] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., device_used_bytes: _Optional[int] = ..., device_peak_bytes: _Optional[int] = ..., host_used_bytes: _Optional[int] = ..., events_received: _Optional[int] = ..., iterations_seen: _Optional[int] = ..., attached_unix_ns: _Optional[int] = ..., state: _Optional[str] = ..., swap_limit_bytes: _Optional[int] = ..., swapped_out_bytes: _Optional[int] = ..., swapped_in_bytes: _Optional[int] = ..., swap_stall_ns: _Optional[int] = ..., plan_misses: _Optional[int] = ..., live_peak_bytes: _Optional[int] = ..., device_floor_bytes: _Optional[int] = ..., device_quota_bytes: _Optional[int] = ..., device_max_bytes: _Optional[int] = ...) -> None: ...
