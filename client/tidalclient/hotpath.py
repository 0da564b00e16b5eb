"""The native hot path (`_native/hotpath.c`) from Python: lease, plans, steps, counters, events.

ctypes, not a CPython extension module: the library has two callers that must share one state.
PyTorch's `CUDAPluggableAllocator` opens it by path and calls `tidalpool_alloc`/`tidalpool_free`
from C++ with no interpreter in between, so it is a plain C shared object that does not touch the
Python C API (an extension module would tie it to one interpreter's ABI and its import), and a
second opening of the same file yields the same loaded copy. Python's calls here come once per
iteration or per batch of events, never per allocation, so ctypes' cost of about a microsecond a
call does not matter, and ctypes releases the GIL during each call.

    HotPath (this module) ──ctypes──▶ hotpath.so ◀──dlopen── torch CUDAPluggableAllocator
      configure · install_plan · step                 tidalpool_alloc · tidalpool_free
      stats · drain (batches of events)               (any thread; one spinlock per device)

On the C side nothing raises: a failed allocation is NULL and counted. Here bad input raises
(ValueError, TypeError, InvalidBlock, PlanRejected) naming the problem.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import sysconfig
import threading
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, SupportsIndex

import numpy as np
import numpy.typing as npt
from tidalcore.events import ALLOC, ITER
from tidalcore.units import ALIGNMENT

from tidalclient.errors import InvalidBlock, TidalpoolError
from tidalclient.plans import PlanRejected, PlanTable
from tidalclient.recorder import TraceSink

ABI = 5
"""The library's `TIDALPOOL_ABI` this module is written against."""
MAX_DEVICES = 64
ALLOC_SYMBOL = "tidalpool_alloc"
"""What to pass to CUDAPluggableAllocator with `library_path()`, with FREE_SYMBOL."""
FREE_SYMBOL = "tidalpool_free"
RECORD_STREAM_SYMBOL = "tidalpool_record_stream"
"""PyTorch's record-stream function (`_CUDAPluggableAllocator.set_record_stream_fn`)."""

EVENT_DTYPE = np.dtype(
    [
        ("kind", "<u4"),  # ALLOC, FREE or ITER (the recorder's kinds)
        ("slot", "<i4"),  # plan slot of a planned block, -1 when placed online
        ("seq", "<u8"),  # the device's event number; gaps are events lost to a full ring
        ("block", "<u8"),  # block id; the iteration number for ITER
        ("size", "<u8"),  # bytes asked for (also on FREE)
        ("offset", "<u8"),  # from the lease's base
        ("t_ns", "<u8"),  # CLOCK_MONOTONIC
    ]
)
"""One `tidalpool_event`, 48 bytes."""

Events = npt.NDArray[np.void]
"""A batch of drained events, structured by EVENT_DTYPE."""

_OK, _EDEVICE, _EINVAL, _EBUSY, _ENOMEM, _ENOLEASE = 0, -1, -2, -3, -4, -5
_NO_TIMESTAMPS = 1
_U64 = ctypes.c_uint64
_P = ctypes.c_void_p


class NativeError(TidalpoolError):
    """The native library refused a control call (no lease yet, blocks live, out of memory)."""


class NativeUnavailable(NativeError, FileNotFoundError):
    """The shared object was not built (install the package: `pip install -e .`)."""


@dataclass(frozen=True, slots=True)
class NativeStats:
    """The counters of one device, in `tidalpool_stats` order."""

    mallocs: int
    frees: int
    hits: int  # allocations served from the plan
    misses: int  # planned-mode allocations that went online (size, order or conflict)
    online: int  # allocations placed by best-fit (learning, and misses)
    fallbacks: int  # plans abandoned for too many misses in an iteration
    failures: int  # NULL returned for a non-zero size (no room, no lease, no host memory)
    zero_allocs: int  # size-0 requests (NULL, as cudaMalloc gives)
    bad_frees: int  # frees of a pointer that is not a live block
    live_blocks: int
    live_bytes: int  # sum of the sizes asked for
    peak_live_bytes: int
    used_bytes: int  # the lease bytes not free (aligned blocks and the plan region)
    events: int  # events produced, dropped ones included
    overflow: int  # events dropped because the ring was full
    iteration: int
    plan_id: int  # the plan in use (0: none)
    planned: bool  # a plan serves allocations
    free_ranges: int
    largest_free: int
    streams: int  # streams tracked for ordering (at most 16 at once)
    cross_stream: int  # allocations on a stream that first had to wait for others' frees
    stream_waits: int  # GPU waits inserted for them (0 until order_streams is set)
    stream_errors: int  # driver calls of stream ordering that failed
    untracked_stream: int  # allocations on a new stream while all 16 slots held live blocks
    stream_records: int  # blocks recorded as used by another stream (record_stream)
    streams_recycled: int  # slots handed from a stream with no live block to a new one


_STATS = len(fields(NativeStats))


def library_path() -> Path:
    """The built shared object (what CUDAPluggableAllocator loads); NativeUnavailable if absent."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    path = Path(__file__).resolve().parent / "_native" / f"hotpath{suffix}"
    if not path.exists():
        raise NativeUnavailable(f"{path} is not built: install the package (pip install -e .)")
    return path


@functools.cache
def load(path: Path | None = None) -> ctypes.CDLL:
    """The library at `path` (default `library_path()`), its signatures declared, ABI checked."""
    lib = ctypes.CDLL(str(path or library_path()))
    i, u32, i64, u64 = ctypes.c_int, ctypes.c_uint32, ctypes.c_int64, _U64
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "tidalpool_abi": (u32, []),
        "tidalpool_alloc": (_P, [ctypes.c_size_t, i, _P]),
        "tidalpool_try_alloc": (_P, [ctypes.c_size_t, i, _P]),
        "tidalpool_free": (None, [_P, ctypes.c_size_t, i, _P]),
        "tidalpool_release": (i, [i, _P]),
        "tidalpool_block_id": (i64, [i, _P]),
        "tidalpool_configure": (i, [i, u64, u64, u64, u64, u32, u32]),
        "tidalpool_reset": (i, [i]),
        "tidalpool_install_plan": (i, [i, u64, u64, _P, _P, u64]),
        "tidalpool_step": (i64, [i]),
        "tidalpool_stats": (i, [i, _P, ctypes.c_size_t]),
        "tidalpool_drain": (i64, [i, _P, u64]),
        "tidalpool_free_ranges": (i64, [i, _P, u64]),
        "tidalpool_stray_calls": (u64, []),
        "tidalpool_on_failure": (None, [_P]),
        "tidalpool_order_streams": (None, [_P, _P, _P, _P]),
        "tidalpool_record_stream": (None, [_P, _P]),
        "tidalpool_record_stream_on": (i, [i, _P, _P]),
        "tidalpool_bench_replay": (i64, [i, _P, u64, _P, _P, u64, _P, u64, u32, _P]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    found = int(lib.tidalpool_abi())
    if found != ABI:
        raise NativeError(f"{path or library_path()} has ABI {found}, this module expects {ABI}")
    return lib


def _whole(value: object, what: str) -> int:
    """An int (NumPy integers too; not bools or floats), else TypeError."""
    if type(value) is int:  # the common case, without the protocol check's cost
        return value
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    return operator.index(value)


def _u64(values: object) -> npt.NDArray[np.uint64]:
    return np.ascontiguousarray(np.asarray(values, dtype=np.uint64))


_drain_locks = [threading.Lock() for _ in range(MAX_DEVICES)]  # one consumer per device ring


class HotPath:
    """One device's allocator state in the native library (shared with PyTorch's calls)."""

    __slots__ = ("_lib", "device")

    def __init__(self, device: int = 0, library: ctypes.CDLL | None = None) -> None:
        device = _whole(device, "device")
        if not 0 <= device < MAX_DEVICES:
            raise ValueError(f"device {device} is out of range [0, {MAX_DEVICES})")
        self.device = device
        self._lib = library if library is not None else load()

    def _check(self, code: int, what: str) -> int:
        if code >= 0:
            return code
        if code == _ENOLEASE:
            raise NativeError(f"{what}: device {self.device} has no lease (call configure first)")
        if code == _EBUSY:
            raise NativeError(f"{what}: device {self.device} is busy (blocks live, or a drain)")
        if code == _ENOMEM:
            raise MemoryError(f"{what}: out of host memory for the native tables")
        raise ValueError(f"{what}: rejected by the native library (code {code})")

    # -- lease ---------------------------------------------------------------------------------
    def configure(
        self,
        base: int,
        capacity: int,
        *,
        alignment: int = ALIGNMENT,
        ring_events: int = 1 << 16,
        max_iteration_misses: int = 8,
        timestamps: bool = True,
    ) -> None:
        """Serve allocations from [base, base + capacity) (the session's device lease).

        `timestamps=False` leaves events' t_ns at 0 and saves a clock read per event (the
        recorder does not send them). Counters restart; NativeError while blocks of an earlier
        lease are live."""
        base, capacity = _whole(base, "base"), _whole(capacity, "capacity")
        alignment, ring = _whole(alignment, "alignment"), _whole(ring_events, "ring_events")
        misses = _whole(max_iteration_misses, "max_iteration_misses")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if base <= 0 or base % alignment:
            raise ValueError(f"lease base {base:#x} must be non-zero and {alignment}-aligned")
        if capacity < 0 or base + capacity > 2**64 - 1:
            raise ValueError(f"lease capacity {capacity} at {base:#x} is beyond the address space")
        if not 2 <= ring <= 2**32:
            raise ValueError(f"ring_events must be in [2, 2**32], got {ring}")
        if not 0 <= misses < 2**32:
            raise ValueError(f"max_iteration_misses must be in [0, 2**32), got {misses}")
        flags = 0 if timestamps else _NO_TIMESTAMPS
        code = self._lib.tidalpool_configure(
            self.device, base, capacity, alignment, ring, misses, flags
        )
        self._check(int(code), "configure")

    def reset(self) -> None:
        """Forget the lease, blocks, plans, counters and events (the session is over)."""
        self._check(int(self._lib.tidalpool_reset(self.device)), "reset")

    # -- allocation (what PyTorch calls in C; here for tests, tools and non-torch callers) ----
    def alloc(self, nbytes: int, stream: int = 0) -> int | None:
        """The address of a new block of `nbytes` for work on `stream` (a CUDA stream handle,
        0 the default stream), or None when it does not fit (counted; a `FailureHandler` is
        called first, a handler given by address is not)."""
        nbytes = _whole(nbytes, "allocation size")
        if not 0 < nbytes < 2**64:
            raise ValueError(f"allocation of {nbytes} bytes: size must be in [1, 2**64)")
        stream = _whole(stream, "stream")
        # A failure handler given as an address is C or C++ that may throw (PyTorch's), which
        # would abort the process through ctypes: then the handler is not called.
        throws = isinstance(_failure_handler, int)
        allocate = self._lib.tidalpool_try_alloc if throws else self._lib.tidalpool_alloc
        address = allocate(nbytes, self.device, stream or None)
        return int(address) if address else None

    def free(self, address: int) -> None:
        """Return a block; InvalidBlock (counted as a bad free) when it is not a live block."""
        address = _whole(address, "address")
        if not 0 <= address < 2**64:
            raise ValueError(f"address {address} is not a 64-bit address")
        if self._lib.tidalpool_release(self.device, address) == _EINVAL:
            raise InvalidBlock(f"{address:#x} is not a live block on device {self.device}")

    def block_id(self, address: int) -> int:
        """The trace's id of the live block at `address` (its ALLOC event's); InvalidBlock
        (counted as a bad free) when it is not a live block."""
        address = _whole(address, "address")
        if not 0 <= address < 2**64:
            raise ValueError(f"address {address} is not a 64-bit address")
        found = int(self._lib.tidalpool_block_id(self.device, address))
        if found == _EINVAL:
            raise InvalidBlock(f"{address:#x} is not a live block on device {self.device}")
        return self._check(found, "block_id")

    def record_stream(self, address: int, stream: int) -> None:
        """Work on `stream` uses the block at `address` too (PyTorch's `record_stream`): when
        it is freed, allocations on other streams wait for that stream's queued work.
        InvalidBlock (counted as a bad free) when `address` is not a live block, NativeError
        when the device has no lease."""
        address = _whole(address, "address")
        if not 0 <= address < 2**64:
            raise ValueError(f"address {address} is not a 64-bit address")
        stream = _whole(stream, "stream")
        code = int(self._lib.tidalpool_record_stream_on(self.device, address, stream or None))
        if code == _EINVAL:
            raise InvalidBlock(f"{address:#x} is not a live block on device {self.device}")
        self._check(code, "record_stream")

    # -- plans and iterations ------------------------------------------------------------------
    def install_plan(self, table: PlanTable) -> None:
        """Use this plan from the next step at which the plan in use holds no live block."""
        sizes, offsets = _u64(table.sizes), _u64(table.offsets)
        code = int(
            self._lib.tidalpool_install_plan(
                self.device,
                table.plan_id,
                len(sizes),
                sizes.ctypes.data,
                offsets.ctypes.data,
                table.height,
            )
        )
        if code == _EINVAL:
            raise PlanRejected(
                f"plan {table.plan_id}: a slot is misaligned for this lease or its height"
                f" {table.height} exceeds the lease"
            )
        self._check(code, f"install plan {table.plan_id}")

    def step(self) -> int:
        """An iteration boundary (plans switch here); the new iteration number."""
        return self._check(int(self._lib.tidalpool_step(self.device)), "step")

    # -- views ---------------------------------------------------------------------------------
    def stats(self) -> NativeStats:
        out = (_U64 * _STATS)()
        self._check(int(self._lib.tidalpool_stats(self.device, out, _STATS)), "stats")
        values: dict[str, Any] = {
            f.name: int(v) for f, v in zip(fields(NativeStats), out, strict=True)
        }
        values["planned"] = bool(values["planned"])
        return NativeStats(**values)

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range of the lease, by offset."""
        room = 64
        while True:
            out = np.zeros(2 * room, dtype=np.uint64)
            n = self._check(
                int(self._lib.tidalpool_free_ranges(self.device, out.ctypes.data, room)),
                "free_ranges",
            )
            if n <= room:
                return [(int(out[2 * i]), int(out[2 * i + 1])) for i in range(n)]
            room = n + 16

    # -- events --------------------------------------------------------------------------------
    def drain_into(self, out: Events) -> int:
        """Move events, oldest first, into the start of `out` (EVENT_DTYPE, contiguous)."""
        if out.dtype != EVENT_DTYPE or not out.flags.c_contiguous or not out.flags.writeable:
            raise TypeError("drain_into needs a writable contiguous array of EVENT_DTYPE")
        with _drain_locks[self.device]:
            code = self._lib.tidalpool_drain(self.device, out.ctypes.data, len(out))
        return self._check(int(code), "drain")

    def drain(self, max_events: int = 1 << 16) -> Events:
        """Up to `max_events` events, oldest first (a new array)."""
        out = np.empty(_whole(max_events, "max_events"), dtype=EVENT_DTYPE)
        return out[: self.drain_into(out)]

    # -- benchmark support ---------------------------------------------------------------------
    def replay(
        self,
        table: npt.NDArray[np.uint64],
        handles: npt.NDArray[np.uint64],
        sizes: npt.NDArray[np.uint64],
        renames: npt.NDArray[np.uint64],
        rounds: int,
    ) -> tuple[int, npt.NDArray[np.int64]]:
        """`tidalpool_bench_replay`: (allocations that failed, nanoseconds of each round).

        Op k allocates sizes[k] bytes into table[handles[k]], or frees it when sizes[k] is 0;
        after each round, table[b] = table[a] for each row (a, b) of renames. `table` holds
        addresses and is updated in place (blocks allocated before stay valid in it)."""
        if table.dtype != np.uint64 or not table.flags.c_contiguous:
            raise TypeError("table must be a contiguous uint64 array")
        handles, sizes, renames = _u64(handles), _u64(sizes), _u64(renames).reshape(-1, 2)
        if len(handles) != len(sizes):
            raise ValueError(f"{len(handles)} handles but {len(sizes)} sizes")
        if (len(handles) and handles.max() >= len(table)) or (
            renames.size and renames.max() >= len(table)
        ):
            raise ValueError(f"a handle is beyond the table of {len(table)}")
        round_ns = np.zeros(_whole(rounds, "rounds"), dtype=np.int64)
        failed = self._lib.tidalpool_bench_replay(
            self.device,
            table.ctypes.data,
            len(table),
            handles.ctypes.data,
            sizes.ctypes.data,
            len(handles),
            renames.ctypes.data,
            len(renames),
            len(round_ns),
            round_ns.ctypes.data,
        )
        return self._check(int(failed), "replay"), round_ns


def stray_calls(library: ctypes.CDLL | None = None) -> int:
    """Allocator calls with a device index out of range, over the process's life."""
    return int((library if library is not None else load()).tidalpool_stray_calls())


FailureHandler = ctypes.CFUNCTYPE(
    None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_char_p
)
"""The C type of a failure handler: (function, file, line, message)."""

# Every callback ever installed stays alive: a thread that loaded one may call it after another
# thread replaced it (the library calls it outside its lock). A process installs a few at most.
_failure_handlers: list[object] = []
_failure_handler: object = None  # the one installed now


def on_failure(handler: int | Any | None, library: ctypes.CDLL | None = None) -> None:
    """What `tidalpool_alloc` calls, once its lock is released, when it returns NULL for a
    non-zero size: a C function's address (PyTorch's `c10::detail::torchCheckFail`, which
    throws, so the allocation raises in Python), a `FailureHandler` callback, or None to
    return NULL silently (the default)."""
    global _failure_handler
    lib = library if library is not None else load()
    if handler is None:
        lib.tidalpool_on_failure(None)
    elif isinstance(handler, int):
        if handler <= 0:
            raise ValueError(f"failure handler address {handler:#x} is not a function")
        lib.tidalpool_on_failure(handler)
    elif isinstance(handler, FailureHandler):
        if not any(h is handler for h in _failure_handlers):
            _failure_handlers.append(handler)
        lib.tidalpool_on_failure(ctypes.cast(handler, _P))
    else:
        raise TypeError(f"a failure handler is an address or a FailureHandler, not {handler!r}")
    _failure_handler = handler


def record_stream_address(library: ctypes.CDLL | None = None) -> int:
    """The address of `tidalpool_record_stream`, for PyTorch's `set_record_stream_fn`."""
    lib = library if library is not None else load()
    return int(ctypes.cast(getattr(lib, RECORD_STREAM_SYMBOL), _P).value or 0)


StreamFunctions = tuple[int, int, int, int]
"""Addresses of cuEventCreate, cuEventRecord, cuStreamWaitEvent, cuEventDestroy_v2 (or
functions with their signatures)."""


def order_streams(functions: StreamFunctions | None, library: ctypes.CDLL | None = None) -> None:
    """Let the allocator order streams on the GPU (see hotpath.h, "Stream ordering"): the
    driver's event and stream-wait functions, by address; None turns ordering off."""
    lib = library if library is not None else load()
    if functions is None:
        lib.tidalpool_order_streams(None, None, None, None)
        return
    if len(functions) != 4 or not all(isinstance(f, int) and f > 0 for f in functions):
        raise ValueError(f"order_streams needs four function addresses, got {functions!r}")
    lib.tidalpool_order_streams(*functions)


_RUNTIME = (
    "cudaEventCreateWithFlags",
    "cudaEventRecord",
    "cudaStreamWaitEvent",
    "cudaEventDestroy",
)
_DRIVER = ("cuEventCreate", "cuEventRecord", "cuStreamWaitEvent", "cuEventDestroy_v2")


def loaded_cuda_runtime(maps: str = "/proc/self/maps") -> str | None:
    """The path of the CUDA runtime (libcudart) this process has loaded, if any (PyTorch's)."""
    with suppress(OSError), open(maps) as f:
        for line in f:
            path = line.rsplit(" ", 1)[-1].strip()
            if Path(path).name.startswith("libcudart.so"):
                return path
    return None


def cuda_stream_functions() -> StreamFunctions:
    """The functions `order_streams` calls: those of the CUDA runtime the process has loaded
    (PyTorch's), which act in the primary context of the calling thread's current device, as
    PyTorch's allocations do, even on a thread where no context is current yet (autograd's);
    else the driver's, from libcuda.so.1, which need one. Their signatures are the same."""
    runtime = loaded_cuda_runtime()
    lib = ctypes.CDLL(runtime or "libcuda.so.1")
    names = _RUNTIME if runtime else _DRIVER
    found = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names]
    return (int(found[0] or 0), int(found[1] or 0), int(found[2] or 0), int(found[3] or 0))


def recorder_events(events: Events) -> Iterator[tuple[int, int, int]]:
    """(kind, block id, size) as the Python executor records them: size 0 on FREE and ITER."""
    kinds = events["kind"]
    sizes = np.where(kinds == ALLOC, events["size"], 0)
    return zip(kinds.tolist(), events["block"].tolist(), sizes.tolist(), strict=True)


def forward(events: Events, recorder: TraceSink) -> None:
    """Hand drained events to a recorder in order: mallocs and frees, ITER as a step mark."""
    for kind, block, size in recorder_events(events):
        if kind == ITER:
            recorder.step(block)
        else:
            recorder.record(kind, block, size)


assert EVENT_DTYPE.itemsize == 48
