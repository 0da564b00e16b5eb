from tidalcore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_ALLOC: _ClassVar[EventKind]
    EVENT_KIND_FREE: _ClassVar[EventKind]
    EVENT_KIND_READ: _ClassVar[EventKind]
    EVENT_KIND_WRITE: _ClassVar[EventKind]
    EVENT_KIND_OP: _ClassVar[EventKind]
    EVENT_KIND_ITER: _ClassVar[EventKind]
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_ALLOC: EventKind
EVENT_KIND_FREE: EventKind
EVENT_KIND_READ: EventKind
EVENT_KIND_WRITE: EventKind
EVENT_KIND_OP: EventKind
EVENT_KIND_ITER: EventKind

class AttachRequest(_message.Message):
    __slots__ = ("client_version", "pid", "swap_limit_bytes", "copy_gbps", "page_bytes")
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SWAP_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_GBPS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    client_version: str
    pid: int
    swap_limit_bytes: int
    copy_gbps: float
    page_bytes: int
    def __init__(self, client_version: _Optional[str] = ..., pid: _Optional[int] = ..., swap_limit_bytes: _Optional[int] = ..., copy_gbps: _Optional[float] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("session_id", "lease", "heartbeat_interval_ms", "trace_chunk_events", "plan_shapes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CHUNK_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_SHAPES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease: _common_pb2.Lease
    heartbeat_interval_ms: int
    trace_chunk_events: int
    plan_shapes: int
    def __init__(self, session_id: _Optional[str] = ..., lease: _Optional[_Union[_common_pb2.Lease, _Mapping]] = ..., heartbeat_interval_ms: _Optional[int] = ..., trace_chunk_events: _Optional[int] = ..., plan_shapes: _Optional[int] = ...) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("heartbeat", "trace", "step", "lease_return")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEASE_RETURN_FIELD_NUMBER: _ClassVar[int]
    heartbeat: Heartbeat
    trace: TraceChunk
    step: StepMark
    lease_return: LeaseReturn
    def __init__(self, heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., trace: _Optional[_Union[TraceChunk, _Mapping]] = ..., step: _Optional[_Union[StepMark, _Mapping]] = ..., lease_return: _Optional[_Union[LeaseReturn, _Mapping]] = ...) -> None: ...

class LeaseReturn(_message.Message):
    __slots__ = ("device_chunks", "quota_id", "shortfall")
    DEVICE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_ID_FIELD_NUMBER: _ClassVar[int]
    SHORTFALL_FIELD_NUMBER: _ClassVar[int]
    device_chunks: _containers.RepeatedScalarFieldContainer[int]
    quota_id: int
    shortfall: str
    def __init__(self, device_chunks: _Optional[_Iterable[int]] = ..., quota_id: _Optional[int] = ..., shortfall: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("device_used_bytes", "device_peak_bytes", "host_used_bytes", "plan_misses", "swapped_out_bytes", "swapped_in_bytes", "swap_stall_ns", "on_demand_out_bytes", "on_demand_in_bytes", "live_peak_bytes")
    DEVICE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_MISSES_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_STALL_NS_FIELD_NUMBER: _ClassVar[int]
    ON_DEMAND_OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ON_DEMAND_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIVE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    device_used_bytes: int
    device_peak_bytes: int
    host_used_bytes: int
    plan_misses: int
    swapped_out_bytes: int
    swapped_in_bytes: int
    swap_stall_ns: int
    on_demand_out_bytes: int
    on_demand_in_bytes: int
    live_peak_bytes: int
    def __init__(self, device_used_bytes: _Optional[int] = ..., device_peak_bytes: _Optional[int] = ..., host_used_bytes: _Optional[int] = ..., plan_misses: _Optional[int] = ..., swapped_out_bytes: _Optional[int] = ..., swapped_in_bytes: _Optional[int] = ..., swap_stall_ns: _Optional[int] = ..., on_demand_out_bytes: _Optional[int] = ..., on_demand_in_bytes: _Optional[int] = ..., live_peak_bytes: _Optional[int] = ...) -> None: ...

class TraceChunk(_message.Message):
    __slots__ = ("first_event", "kinds", "block_ids", "sizes", "durations_ns", "name_ids", "new_names")
    class NewNamesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    FIRST_EVENT_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    DURATIONS_NS_FIELD_NUMBER: _ClassVar[int]
    NAME_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_NAMES_FIELD_NUMBER: _ClassVar[int]
    first_event: int
    kinds: _containers.RepeatedScalarFieldContainer[EventKind]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    durations_ns: _containers.RepeatedScalarFieldContainer[int]
    name_ids: _containers.RepeatedScalarFieldContainer[int]
    new_names: _containers.ScalarMap[int, str]
    def __init__(self, first_event: _Optional[int] = ..., kinds: _Optional[_Iterable[_Union[EventKind, str]]] = ..., block_ids: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., durations_ns: _Optional[_Iterable[int]] = ..., name_ids: _Optional[_Iterable[int]] = ..., new_names: _Optional[_Mapping[int, str]] = ...) -> None: ...

class StepMark(_message.Message):
    __slots__ = ("iteration", "events_before", "live_block_ids", "live_addresses", "live_owning", "shape")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    LIVE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    LIVE_OWNING_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    events_before: int
    live_block_ids: _containers.RepeatedScalarFieldContainer[int]
    live_addresses: _containers.RepeatedScalarFieldContainer[int]
    live_owning: _containers.RepeatedScalarFieldContainer[bool]
    shape: str
    def __init__(self, iteration: _Optional[int] = ..., events_before: _Optional[int] = ..., live_block_ids: _Optional[_Iterable[int]] = ..., live_addresses: _Optional[_Iterable[int]] = ..., live_owning: _Optional[_Iterable[bool]] = ..., shape: _Optional[str] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("plan", "quota", "error", "goodbye", "unplanned")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    UNPLANNED_FIELD_NUMBER: _ClassVar[int]
    plan: PlanUpdate
    quota: QuotaChange
    error: SessionError
    goodbye: Goodbye
    unplanned: PlanUnavailable
    def __init__(self, plan: _Optional[_Union[PlanUpdate, _Mapping]] = ..., quota: _Optional[_Union[QuotaChange, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ..., unplanned: _Optional[_Union[PlanUnavailable, _Mapping]] = ...) -> None: ...

class PlanUpdate(_message.Message):
    __slots__ = ("plan_id", "signature", "sizes", "offsets", "height_bytes", "swap_blocks", "swap_persistent", "swap_out_after", "swap_in_at", "swap_in_before", "version", "swap_in_offsets", "recompute_blocks", "recompute_drop_after", "recompute_before", "limit_bytes", "resident_persistent_bytes", "prediction", "swap_in_ticks", "page_bytes", "addresses", "owning", "region_bytes", "mapped_peak_bytes", "shape")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_AFTER_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_AT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_BEFORE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_DROP_AFTER_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_PERSISTENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_TICKS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    OWNING_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAPPED_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    plan_id: int
    signature: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    height_bytes: int
    swap_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_persistent: _containers.RepeatedScalarFieldContainer[bool]
    swap_out_after: _containers.RepeatedScalarFieldContainer[int]
    swap_in_at: _containers.RepeatedScalarFieldContainer[int]
    swap_in_before: _containers.RepeatedScalarFieldContainer[int]
    version: int
    swap_in_offsets: _containers.RepeatedScalarFieldContainer[int]
    recompute_blocks: _containers.RepeatedScalarFieldContainer[int]
    recompute_drop_after: _containers.RepeatedScalarFieldContainer[int]
    recompute_before: _containers.RepeatedScalarFieldContainer[int]
    limit_bytes: int
    resident_persistent_bytes: int
    prediction: PlanPrediction
    swap_in_ticks: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: int
    addresses: _containers.RepeatedScalarFieldContainer[int]
    owning: _containers.RepeatedScalarFieldContainer[bool]
    region_bytes: int
    mapped_peak_bytes: int
    shape: str
    def __init__(self, plan_id: _Optional[int] = ..., signature: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., height_bytes: _Optional[int] = ..., swap_blocks: _Optional[_Iterable[int]] = ..., swap_persistent: _Optional[_Iterable[bool]] = ..., swap_out_after: _Optional[_Iterable[int]] = ..., swap_in_at: _Optional[_Iterable[int]] = ..., swap_in_before: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ..., swap_in_offsets: _Optional[_Iterable[int]] = ..., recompute_blocks: _Optional[_Iterable[int]] = ..., recompute_drop_after: _Optional[_Iterable[int]] = ..., recompute_before: _Optional[_Iterable[int]] = ..., limit_bytes: _Optional[int] = ..., resident_persistent_bytes: _Optional[int] = ..., prediction: _Optional[_Union[PlanPrediction, _Mapping]] = ..., swap_in_ticks: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[int] = ..., addresses: _Optional[_Iterable[int]] = ..., owning: _Optional[_Iterable[bool]] = ..., region_bytes: _Optional[int] = ..., mapped_peak_bytes: _Optional[int] = ..., shape: _Optional[str] = ...) -> None: ...

class PlanPrediction(_message.Message):
    __slots__ = ("step_ns", "baseline_ns", "out_bytes", "in_bytes", "stall_ns", "peak_bytes", "footprint_bytes", "copy_gbps")
    STEP_NS_FIELD_NUMBER: _ClassVar[int]
    BASELINE_NS_FIELD_NUMBER: _ClassVar[int]
    OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    STALL_NS_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_GBPS_FIELD_NUMBER: _ClassVar[int]
    step_ns: int
    baseline_ns: int
    out_bytes: int
    in_bytes: int
    stall_ns: int
    peak_bytes: int
    footprint_bytes: int
    copy_gbps: float
    def __init__(self, step_ns: _Optional[int] = ..., baseline_ns: _Optional[int] = ..., out_bytes: _Optional[int] = ..., in_bytes: _Optional[int] = ..., stall_ns: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., footprint_bytes: _Optional[int] = ..., copy_gbps: _Optional[float] = ...) -> None: ...

class PlanUnavailable(_message.Message):
    __slots__ = ("limit_bytes", "kind", "reason", "lowest_limit_bytes", "shape")
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOWEST_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    limit_bytes: int
    kind: str
    reason: str
    lowest_limit_bytes: int
    shape: str
    def __init__(self, limit_bytes: _Optional[int] = ..., kind: _Optional[str] = ..., reason: _Optional[str] = ..., lowest_limit_bytes: _Optional[int] = ..., shape: _Optional[str] = ...) -> None: ...

class QuotaChange(_message.Message):
    __slots__ = ("device_limit_bytes", "host_limit_bytes", "reason", "quota_id", "deadline_ms", "device_chunks")
    DEVICE_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    QUOTA_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    device_limit_bytes: int
    host_limit_bytes: int
    reason: str
    quota_id: int
    deadline_ms: int
    device_chunks: int
    def __init__(self, device_limit_bytes: _Optional[int] = ..., host_limit_bytes: _Optional[int] = ..., reason: _Optional[str] = ..., quota_id: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., device_chunks: _Optional[int] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason", "message")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[Goodbye.Reason]
        REASON_DETACHED: _ClassVar[Goodbye.Reason]
        REASON_EVICTED: _ClassVar[Goodbye.Reason]
        REASON_SHUTDOWN: _ClassVar[Goodbye.Reason]
    REASON_UNSPECIFIED: Goodbye.Reason
    REASON_DETACHED: Goodbye.Reason
    REASON_EVICTED: Goodbye.Reason
    REASON_SHUTDOWN: Goodbye.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: Goodbye.Reason
    message: str
    def __init__(self, reason: _Optional[_Union[Goodbye.Reason, str]] = ..., message: _Optional[str] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("last",)
    LAST_FIELD_NUMBER: _ClassVar[int]
    last: Heartbeat
    def __init__(self, last: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.SessionInfo
    def __init__(self, session: _Optional[_Union[_common_pb2.SessionInfo, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.SessionInfo
    def __init__(self, session: _Optional[_Union[_common_pb2.SessionInfo, _Mapping]] = ...) -> None: ...
