"""Mapping a cuda lease, and the streams and events the swap engine copies on.

Device lease, "vmm" mode: the client receives one fd per chunk of its lease (and no other),
imports each, and maps them in lease order into one range it reserves:

    reserve  base ─────────────────────────────── base + n*chunk
    map      | fd0 → h0 | fd1 → h1 | ... | fdn-1 |     chunk k at base + k*chunk
    access   read/write for this device over [base, base + n*chunk)

`retire()` unmaps the chunks and releases the imports, then maps one private scratch
allocation over the whole range: a stale pointer reads zeros (or its own stale writes) and can
never reach memory the pool has since leased to another session, and no kernel faults.

Device lease, "ipc" mode (the fallback without fd export): the client opens the pool's legacy
IPC handle, which maps the WHOLE pool, and uses its lease at an offset. Sessions are not
isolated from each other in this mode.

Host lease: one memfd per chunk, mapped shared in lease order into one reserved range and
page-locked (cuMemHostRegister) as a whole, so async copies run at full speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from tidalcore.cuda_driver import (
    CudaError,
    DevicePtr,
    Driver,
    EventHandle,
    MemHandle,
    StreamHandle,
)
from tidalcore.units import format_size

from tidalclient.devices.streams import StreamError
from tidalclient.timeline import CudaClock, Timeline

log = logging.getLogger("tidalpool")


def _check_chunks(count: int, chunk_bytes: int) -> None:
    if count <= 0 or chunk_bytes <= 0:
        raise ValueError(f"a lease of {count} chunks of {chunk_bytes} bytes maps nothing")


class CudaDeviceMapping:
    """A "vmm" device lease: the chunks behind `fds`, contiguous at `address`.

    The fds stay the caller's (close them once the mapping is made: the imports hold the
    memory). `granularity` is the device's allocation granularity (the scratch allocation of
    `retire`); `chunk_bytes` is a multiple of it.
    """

    def __init__(
        self, driver: Driver, fds: Sequence[int], chunk_bytes: int, granularity: int
    ) -> None:
        _check_chunks(len(fds), chunk_bytes)
        if granularity <= 0 or chunk_bytes % granularity:
            raise ValueError(f"chunk of {chunk_bytes} bytes is not a multiple of {granularity}")
        self._driver = driver
        self.chunk_bytes = chunk_bytes
        self.granularity = granularity
        self.length = len(fds) * chunk_bytes
        self.retired = False
        self._handles: list[MemHandle] = []
        self._mapped = 0  # chunks mapped from the base
        self._scratch: MemHandle | None = None
        self._private: list[MemHandle] = []  # `retire(keep=)`'s granules, this process's own
        self._scratch_maps = 0  # granules mapped from the base at `retire`
        self.address = int(driver.address_reserve(self.length, granularity))
        try:
            for fd in fds:
                handle = driver.mem_import_fd(fd)
                self._handles.append(handle)
                driver.mem_map(self._chunk(self._mapped), chunk_bytes, handle)
                self._mapped += 1
            driver.set_access(DevicePtr(self.address), self.length)
        except BaseException:
            self._unmap_lease()
            driver.address_free(DevicePtr(self.address), self.length)
            raise

    @property
    def handles(self) -> tuple[MemHandle, ...]:
        """The chunks' imported VMM handles, in order (valid until `retire`)."""
        return tuple(self._handles)

    def _chunk(self, k: int) -> DevicePtr:
        return DevicePtr(self.address + k * self.chunk_bytes)

    def _unmap_lease(self) -> None:
        """Unmap the lease's chunks (last first) and release the imports."""
        while self._mapped:
            self._mapped -= 1
            self._driver.mem_unmap(self._chunk(self._mapped), self.chunk_bytes)
        while self._handles:
            self._driver.mem_release(self._handles.pop())

    def read(self, offset: int, nbytes: int) -> bytes:
        """The bytes [offset, offset+nbytes) of the lease (synchronous copy; tests)."""
        self._check_range(offset, nbytes)
        out = ctypes.create_string_buffer(nbytes)
        self._driver.memcpy_dtoh(ctypes.addressof(out), DevicePtr(self.address + offset), nbytes)
        return out.raw

    def write(self, offset: int, data: bytes) -> None:
        """Write `data` at `offset` of the lease (synchronous copy; tests)."""
        self._check_range(offset, len(data))
        src = ctypes.create_string_buffer(data, len(data))
        self._driver.memcpy_htod(DevicePtr(self.address + offset), ctypes.addressof(src), len(data))
        self._driver.stream_synchronize(StreamHandle(0))  # a pageable copy may still be in flight

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise ValueError(f"range {offset}+{nbytes} is outside the lease of {self.length} bytes")

    def retire(self, keep: Sequence[tuple[int, bytes]] = ()) -> None:
        """Give the lease's chunks back; stale pointers into the range reach only scratch
        (one zeroed granule, mapped under every page), except the granules under `keep`,
        (offset in the lease, bytes) of arrays the job still holds: each gets private memory
        of this process, zeroed, and the kept bytes are copied back into it."""
        if self.retired:
            return
        for offset, data in keep:
            self._check_range(offset, len(data))  # before anything changes
        self.retired = True
        self._unmap_lease()
        driver, step = self._driver, self.granularity
        own = {
            k for o, data in keep if data for k in range(o // step, (o + len(data) - 1) // step + 1)
        }
        self._scratch = driver.mem_create(step, exportable=False)
        granules = self.length // step
        for k in range(granules):
            if k in own:
                self._private.append(driver.mem_create(step, exportable=False))
            handle = self._private[-1] if k in own else self._scratch
            driver.mem_map(DevicePtr(self.address + k * step), step, handle)
            self._scratch_maps += 1
        driver.set_access(DevicePtr(self.address), self.length)
        stream = StreamHandle(0)
        shared = next((k for k in range(granules) if k not in own), None)
        for k in sorted(own) + ([] if shared is None else [shared]):  # each memory once
            driver.memset_d8_async(DevicePtr(self.address + k * step), 0, step, stream)
        driver.stream_synchronize(stream)
        for offset, data in keep:
            src = ctypes.create_string_buffer(data, len(data))
            driver.memcpy_htod(DevicePtr(self.address + offset), ctypes.addressof(src), len(data))
        driver.stream_synchronize(stream)

    def close(self) -> None:
        """Release everything, the address range too: only when no pointer into it is left."""
        self.retire()
        driver, step = self._driver, self.granularity
        while self._scratch_maps:
            self._scratch_maps -= 1
            driver.mem_unmap(DevicePtr(self.address + self._scratch_maps * step), step)
        while self._private:
            driver.mem_release(self._private.pop())
        if self._scratch is not None:
            driver.mem_release(self._scratch)
            self._scratch = None
            driver.address_free(DevicePtr(self.address), self.length)


class IpcDeviceMapping:
    """An "ipc" device lease: `length` bytes at `offset` of the pool's one allocation.

    Opening the handle maps the whole pool into this process: no isolation between sessions.
    """

    def __init__(self, driver: Driver, ipc_handle: bytes, offset: int, length: int) -> None:
        if offset < 0 or length <= 0:
            raise ValueError(f"lease at offset {offset} of {length} bytes")
        self._driver = driver
        self._base = driver.ipc_open_handle(ipc_handle)
        self.address = int(self._base) + offset
        self.length = length
        self.retired = False

    @classmethod
    def for_chunks(
        cls, driver: Driver, ipc_handle: bytes, chunks: Sequence[int], chunk_bytes: int
    ) -> IpcDeviceMapping:
        """The lease of pool chunks `chunks`: they must be consecutive and ascending, since
        legacy IPC memory cannot be remapped into a contiguous range."""
        _check_chunks(len(chunks), chunk_bytes)
        first = chunks[0]
        if list(chunks) != list(range(first, first + len(chunks))):
            raise ValueError(f"an ipc-mode lease must be consecutive chunks, got {list(chunks)}")
        return cls(driver, ipc_handle, first * chunk_bytes, len(chunks) * chunk_bytes)

    def read(self, offset: int, nbytes: int) -> bytes:
        """The bytes [offset, offset+nbytes) of the lease (synchronous copy)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise ValueError(f"range {offset}+{nbytes} is outside the lease of {self.length} bytes")
        out = ctypes.create_string_buffer(nbytes)
        self._driver.memcpy_dtoh(ctypes.addressof(out), DevicePtr(self.address + offset), nbytes)
        return out.raw

    def retire(self, keep: Sequence[tuple[int, bytes]] = ()) -> None:
        """Close the IPC mapping (stale pointers fault: this mode has no scratch range). The
        pool's one allocation cannot be replaced beneath `keep`: their bytes go, said in a
        warning."""
        if self.retired:
            return
        self.retired = True
        held = [len(data) for _, data in keep if data]
        if held:
            log.warning(
                'tidalpool: %d arrays of %d bytes in all are still alive, but an "ipc" lease'
                " cannot keep them past the session (its memory is the pool's one allocation):"
                " using them now faults",
                len(held),
                sum(held),
            )
        self._driver.ipc_close_handle(self._base)


# -- streams and events -----------------------------------------------------------------------


def _destroy_event(driver: Driver, event: EventHandle) -> None:
    with contextlib.suppress(CudaError):  # the context may be gone at interpreter exit
        driver.event_destroy(event)


class CudaEvent:
    """A recorded CUDA event, with the sim `Event` API; destroyed when garbage."""

    __slots__ = ("__weakref__", "_driver", "_errors", "handle")

    def __init__(
        self, driver: Driver, handle: EventHandle, errors: list[BaseException] | None = None
    ) -> None:
        self._driver = driver
        self.handle = handle
        self._errors = errors  # failures of host functions before it, filled in stream order
        weakref.finalize(self, _destroy_event, driver, handle)

    def query(self) -> bool:
        """True once the work before the record has completed (cuEventQuery); never blocks."""
        return self._driver.event_query(self.handle)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until completed; False on timeout. Raises StreamError when work before the
        event failed. It polls (cuEventQuery, then sleeps of up to 0.2 ms) rather than calling
        cuEventSynchronize, so the GIL stays free for host functions in flight: they run
        Python, and a thread blocked in the driver holding the GIL would never let them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0
        try:
            while not self._driver.event_query(self.handle):
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(2 * pause or 5e-6, 2e-4)
        except CudaError as e:
            raise StreamError(f"stream work before this event failed: {e}") from e
        if self._errors:
            raise StreamError(f"stream work before this event failed: {self._errors[0]!r}")
        return True


class CudaStream:
    """A CUDA stream with the sim `Stream` API: in-order copies, host functions, event records
    and waits. `direction` says which way `copy` goes: "d2h" (swap-out) or "h2d" (swap-in).

    `CudaStream.wrap` adopts a stream someone else owns (the compute stream of CuPy or PyTorch)
    so that the swap streams and it can wait on each other's events.
    """

    def __init__(self, driver: Driver, name: str, direction: str = "") -> None:
        if direction not in ("", "d2h", "h2d"):
            raise ValueError(f"copy direction must be 'd2h' or 'h2d', got {direction!r}")
        self._driver = driver
        self.name = name
        self.direction = direction
        self.gbps: float | None = None  # real copies: the link's own speed
        self.bytes_copied = 0
        self.timeline: Timeline | None = None  # each copy a span between timing events, when set
        self._owned = True
        self._closed = False
        self._errors: list[BaseException] = []  # host-function failures since the last record
        self._launched = False
        self.handle = driver.stream_create()

    @classmethod
    def wrap(cls, driver: Driver, handle: int, name: str = "compute") -> CudaStream:
        """A view of an existing stream (not destroyed by `close`)."""
        stream = cls.__new__(cls)
        stream._driver = driver
        stream.name = name
        stream.direction = ""
        stream.gbps = None
        stream.bytes_copied = 0
        stream.timeline = None
        stream._owned = False
        stream._closed = False
        stream._errors = []
        stream._launched = False
        stream.handle = StreamHandle(handle)
        return stream

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError(f"stream {self.name} is closed")

    # -- enqueue ---------------------------------------------------------------------------
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy `nbytes` from `src` to `dst` in this stream's direction (async)."""
        if self.direction == "d2h":
            self.copy_to_host(dst, src, nbytes)
        elif self.direction == "h2d":
            self.copy_to_device(dst, src, nbytes)
        else:
            raise ValueError(f"stream {self.name} has no copy direction; use copy_to_host/device")

    def copy_to_host(self, dst: int, src: int, nbytes: int) -> None:
        """cuMemcpyDtoHAsync: device `src` to (pinned) host `dst`."""
        self._live()
        if nbytes < 0:
            raise ValueError(f"copy of {nbytes} bytes")
        if nbytes:
            start = self.timed() if self.timeline is not None else None
            self._driver.memcpy_dtoh_async(dst, DevicePtr(src), nbytes, self.handle)
            self._copied(start, nbytes)
        self.bytes_copied += nbytes

    def copy_to_device(self, dst: int, src: int, nbytes: int) -> None:
        """cuMemcpyHtoDAsync: (pinned) host `src` to device `dst`."""
        self._live()
        if nbytes < 0:
            raise ValueError(f"copy of {nbytes} bytes")
        if nbytes:
            start = self.timed() if self.timeline is not None else None
            self._driver.memcpy_htod_async(DevicePtr(dst), src, nbytes, self.handle)
            self._copied(start, nbytes)
        self.bytes_copied += nbytes

    def _copied(self, start: CudaEvent | None, nbytes: int) -> None:
        """A copy just enqueued after `start`: its span on the timeline (when one is set)."""
        if start is not None and self.timeline is not None:
            self.timeline.device_span(
                self.name, format_size(nbytes), start, self.timed(), bytes=nbytes
            )

    def timed(self) -> CudaEvent:
        """A timing event recorded now on this stream (for `Timeline.device_span`)."""
        self._live()
        handle = self._driver.event_create(timing=True)
        try:
            self._driver.event_record(handle, self.handle)
        except CudaError:
            _destroy_event(self._driver, handle)
            raise
        return CudaEvent(self._driver, handle)

    def launch(self, fn: Callable[[], object]) -> None:
        """Run `fn` in stream order (cuLaunchHostFunc); it must not call CUDA. A failure is
        reported by the next event recorded on this stream."""
        self._live()
        errors = self._errors

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # reported by the next event, never lost
                errors.append(e)

        self._driver.launch_host_func(self.handle, run)
        self._launched = True

    def record(self) -> CudaEvent:
        """An event that completes after all work enqueued so far (cuEventRecord)."""
        self._live()
        handle = self._driver.event_create(timing=False)
        try:
            self._driver.event_record(handle, self.handle)
        except CudaError:
            _destroy_event(self._driver, handle)
            raise
        errors = None
        if self._launched:  # host functions ran before it: the event reports their failures
            errors, self._errors, self._launched = self._errors, [], False
        return CudaEvent(self._driver, handle, errors)

    def elapsed_ns(self, start: CudaEvent, end: CudaEvent) -> int:
        """The GPU's time from `start` to `end`, two completed timing events (`timed`) of this
        context (cuEventElapsedTime)."""
        return round(self._driver.event_elapsed_ms(start.handle, end.handle) * 1e6)

    def clock(self) -> CudaClock:
        """A clock for this context's timing events: a reference event recorded on this
        stream and waited for, and the host time right after (`Timeline.device_span`s are
        put on the host clock from it)."""
        reference = self.timed()
        reference.wait()
        host_ns = time.perf_counter_ns()
        driver = self._driver
        return CudaClock(
            reference, host_ns, lambda a, b: driver.event_elapsed_ms(a.handle, b.handle)
        )

    def wait_event(self, event: CudaEvent) -> None:
        """Work enqueued after this starts only once `event` has completed (cuStreamWaitEvent);
        the calling thread does not block."""
        self._live()
        self._driver.stream_wait_event(self.handle, event.handle)

    def synchronize(self) -> None:
        """Block until everything enqueued so far has run (as cuStreamSynchronize)."""
        self.record().wait()

    def close(self) -> None:
        """Let the enqueued work finish, then destroy the stream (if owned). Idempotent."""
        if self._closed:
            return
        try:
            if self._owned:
                self.record().wait()  # a failure is raised, and the stream still destroyed
        finally:
            self._closed = True
            if self._owned:
                self._driver.stream_destroy(self.handle)


def swap_streams(driver: Driver) -> tuple[CudaStream, CudaStream]:
    """The swap engine's two streams: out (device→host) and in (host→device)."""
    out = CudaStream(driver, "swap-out", "d2h")
    try:
        return out, CudaStream(driver, "swap-in", "h2d")
    except BaseException:
        out.close()
        raise


def compute_stream(driver: Driver) -> Callable[[], CudaStream]:
    """The stream the ops' kernels run on, as the swap engine orders its copies against it:
    CuPy's current stream when CuPy is installed (looked up at each call, so a `with stream:`
    block of the caller counts), else the legacy default stream."""
    cupy: list[object] = []  # imported on the first call, not before

    def current() -> CudaStream:
        if not cupy:
            try:
                cupy.append(importlib.import_module("cupy"))
            except ImportError:
                cupy.append(None)
        module: Any = cupy[0]
        handle = 0 if module is None else int(module.cuda.get_current_stream().ptr)
        return CudaStream.wrap(driver, handle)

    return current
