"""Fakes of the CUDA driver and of NVML that keep their contracts, for tests without a GPU.

`FakeDriver` holds device memory as bytearrays and enforces what the real driver does: a
mapping needs a reserved range and a live handle, maps a granularity-aligned part of the
allocation from its first byte (all of it, or its first `size` bytes: cuMemMap takes no other
offset) and must not overlap another; access is set over fully mapped ranges only; memory is
read or written only through mappings with access; unmapping takes whole mappings; a range is
freed only once nothing is mapped in it; every handle, stream and event is released at most
once. A broken rule raises `CudaError` with the
error the driver would give, so a wrong call order fails the test.

Exported fds are memfds, and an import finds the allocation by the file the fd refers to
(as the real driver does), so an fd passed to another process with SCM_RIGHTS imports there.
`FakeDriver(peer=other)` is the driver of another process: it imports `other`'s exports and
opens its IPC handles, and shares their memory, with its own address space, context and
streams.

Streams are queues of work. With `eager` (the default) work runs as soon as it is enqueued;
otherwise it runs when a test calls `run`/`run_all`, or when something synchronizes, so tests
can watch events and waits order the streams. A copy of n bytes moves the fake clock by
n / GB/s of its direction, which event timing reads.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tidalcore.cuda_driver import (
    CudaError,
    DeviceFacts,
    DevicePtr,
    EventHandle,
    MemHandle,
    NvmlError,
    StreamHandle,
)

INVALID_VALUE = 1
NOT_INITIALIZED = 3
INVALID_DEVICE = 101
ILLEGAL_ADDRESS = 700
INVALID_HANDLE = 400
NOT_READY = 600
NOT_SUPPORTED = 801
HOST_ALREADY_REGISTERED = 712
HOST_NOT_REGISTERED = 713
_NAMES = {
    INVALID_VALUE: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    NOT_INITIALIZED: "CUDA_ERROR_NOT_INITIALIZED",
    INVALID_DEVICE: "CUDA_ERROR_INVALID_DEVICE",
    INVALID_HANDLE: "CUDA_ERROR_INVALID_HANDLE",
    NOT_READY: "CUDA_ERROR_NOT_READY",
    ILLEGAL_ADDRESS: "CUDA_ERROR_ILLEGAL_ADDRESS",
    HOST_ALREADY_REGISTERED: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
    HOST_NOT_REGISTERED: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
    800: "CUDA_ERROR_NOT_PERMITTED",
    NOT_SUPPORTED: "CUDA_ERROR_NOT_SUPPORTED",
}


def _bus(bus_id: str) -> str:
    """A PCI bus id in cuDeviceGetPCIBusId's form: upper case, with its domain."""
    text = bus_id.strip().upper()
    return text if text.count(":") == 2 else "0000:" + text


def fail(call: str, code: int) -> CudaError:
    return CudaError(call, code, _NAMES.get(code, f"CUresult {code}"))


@dataclass
class Phys:
    """A physical allocation."""

    size: int
    exportable: bool
    data: bytearray = field(init=False)
    handles: int = 0

    def __post_init__(self) -> None:
        self.data = bytearray(b"\xa5" * self.size)  # never zero: the backend must zero it


@dataclass
class Mapping:
    """The first `size` bytes of `phys`, mapped at one address."""

    size: int
    phys: Phys
    access: bool = False


@dataclass
class Event:
    timing: bool
    recorded: bool = False
    done: bool = True
    time_ns: float = 0.0


class FakeDriver:
    """A `Driver` with the real one's rules; see the module doc."""

    def __init__(
        self,
        *,
        granularity: int = 64 * 1024,
        vmm: bool = True,
        export_error: int | None = None,
        h2d_gbps: float = 25.0,
        d2h_gbps: float = 20.0,
        eager: bool = True,
        bus_id: str = "0000:3B:00.0",
        buses: dict[str, int] | None = None,
        peer: FakeDriver | None = None,
    ) -> None:
        self._granularity = granularity
        self._vmm = vmm
        self.export_error = export_error
        self.gbps = {"h2d": h2d_gbps, "d2h": d2h_gbps}
        self.eager = eager
        self.bus_id = bus_id
        # the GPUs this process sees: PCI bus id -> ordinal (CUDA_VISIBLE_DEVICES renumbers)
        self.buses = {_bus(k): v for k, v in (buses or {bus_id: 0}).items()}
        self.ordinal: int | None = None
        self.calls: list[tuple[object, ...]] = []
        self.now_ns = 0.0
        self._ids = itertools.count(1)
        self._va = 1 << 40
        self.handles: dict[int, Phys] = {}
        self.fds: dict[int, Phys] = {}  # fds this process exported (memfds), by number
        # every export, by the file behind its fd: shared with peers (other processes)
        self.exports: dict[tuple[int, int], Phys] = {} if peer is None else peer.exports
        self._peer_allocs: dict[int, Phys] = {} if peer is None else peer.allocs
        self.reserved: dict[int, int] = {}  # base -> size
        self.mappings: dict[int, Mapping] = {}  # address -> mapping
        self.allocs: dict[int, Phys] = {}  # mem_alloc base -> allocation
        self.ipc_opened: dict[int, Phys] = {}
        self.registered: dict[int, int] = {}  # host address -> size
        self.streams: dict[int, deque[Callable[[], bool]]] = {0: deque()}
        self.events: dict[int, Event] = {}
        self.copies: list[tuple[str, int, bool]] = []  # direction, bytes, host pinned

    # -- helpers --------------------------------------------------------------------------
    def _log(self, *call: object) -> None:
        self.calls.append(call)

    def names(self) -> list[str]:
        return [str(c[0]) for c in self.calls]

    def _need_device(self, call: str) -> None:
        if self.ordinal is None:
            raise fail(call, NOT_INITIALIZED)

    def _new_va(self, size: int, alignment: int) -> int:
        align = max(alignment, self._granularity)
        base = -(-self._va // align) * align
        self._va = base + size + self._granularity  # a guard gap between ranges
        return base

    def _segments(self, call: str, ptr: int, size: int) -> list[tuple[Phys, int, int]]:
        """(allocation, offset, length) pieces of [ptr, ptr+size): all mapped with access."""
        out: list[tuple[Phys, int, int]] = []
        at, end = ptr, ptr + size
        while at < end:
            hit = None
            for base, m in self.mappings.items():
                if base <= at < base + m.size:
                    hit = base, m
                    break
            if hit is None or not hit[1].access:
                raise fail(call, ILLEGAL_ADDRESS)
            base, m = hit
            n = min(end, base + m.size) - at
            out.append((m.phys, at - base, n))
            at += n
        return out

    def read(self, ptr: int, size: int, call: str = "read") -> bytes:
        return b"".join(bytes(p.data[o : o + n]) for p, o, n in self._segments(call, ptr, size))

    def write(self, ptr: int, data: bytes, call: str = "write") -> None:
        at = 0
        for p, o, n in self._segments(call, ptr, len(data)):
            p.data[o : o + n] = data[at : at + n]
            at += n

    def _pinned(self, address: int, size: int) -> bool:
        return any(a <= address and address + size <= a + n for a, n in self.registered.items())

    def _enqueue(self, call: str, stream: int, work: Callable[[], bool]) -> None:
        if stream not in self.streams:
            raise fail(call, INVALID_HANDLE)
        self.streams[stream].append(work)
        if self.eager:
            self.run_all()

    def run(self, stream: int) -> bool:
        """Run the stream's work until it is empty or waits; whether anything ran."""
        queue, ran = self.streams[stream], False
        while queue and queue[0]():
            queue.popleft()
            ran = True
        return ran

    def run_all(self) -> None:
        while any(self.run(s) for s in list(self.streams)):
            pass

    def _event(self, call: str, event: int) -> Event:
        if event not in self.events:
            raise fail(call, INVALID_HANDLE)
        return self.events[event]

    def live(self) -> dict[str, int]:
        """What is still held: all zero after a clean close."""
        return {
            "context": int(self.ordinal is not None),
            "handles": len(self.handles),
            "fds": len(self.fds),
            "reserved": len(self.reserved),
            "mappings": len(self.mappings) - len(self.allocs) - len(self.ipc_opened),
            "allocs": len(self.allocs),
            "ipc_opened": len(self.ipc_opened),
            "registered": len(self.registered),
            "streams": len(self.streams) - 1,
            "events": len(self.events),
        }

    # -- device ---------------------------------------------------------------------------
    def open_device(self, ordinal: int) -> None:
        self._log("open_device", ordinal)
        self.ordinal = ordinal

    def close_device(self) -> None:
        self._log("close_device")
        self._need_device("cuDevicePrimaryCtxRelease")
        self.ordinal = None

    def device_by_pci_bus_id(self, bus_id: str) -> int:
        """As cuDeviceGetByPCIBusId: "domain:bus:device.function", any case, the domain
        optional; a GPU this process does not see is CUDA_ERROR_INVALID_DEVICE."""
        self._log("device_by_pci_bus_id", bus_id)
        if bus_id.count(":") not in (1, 2) or "." not in bus_id:
            raise fail("cuDeviceGetByPCIBusId", INVALID_VALUE)
        ordinal = self.buses.get(_bus(bus_id))
        if ordinal is None:
            raise fail("cuDeviceGetByPCIBusId", INVALID_DEVICE)
        return ordinal

    def pci_bus_id(self) -> str:
        self._need_device("cuDeviceGetPCIBusId")
        for bus, ordinal in self.buses.items():
            if ordinal == self.ordinal:
                return bus
        return self.bus_id

    def vmm_supported(self) -> bool:
        self._need_device("cuDeviceGetAttribute")
        return self._vmm

    # -- virtual memory management --------------------------------------------------------
    def granularity(self, *, exportable: bool) -> int:
        self._need_device("cuMemGetAllocationGranularity")
        self._log("granularity", exportable)
        return self._granularity

    def mem_create(self, size: int, *, exportable: bool) -> MemHandle:
        self._need_device("cuMemCreate")
        if size <= 0 or size % self._granularity:
            raise fail("cuMemCreate", INVALID_VALUE)
        handle = next(self._ids)
        phys = Phys(size, exportable)
        phys.handles += 1
        self.handles[handle] = phys
        self._log("mem_create", handle, size, exportable)
        return MemHandle(handle)

    def mem_export_fd(self, handle: MemHandle) -> int:
        phys = self.handles.get(handle)
        if phys is None:
            raise fail("cuMemExportToShareableHandle", INVALID_VALUE)
        if self.export_error is not None:
            raise fail("cuMemExportToShareableHandle", self.export_error)
        if not phys.exportable:
            raise fail("cuMemExportToShareableHandle", INVALID_VALUE)
        fd = os.memfd_create(f"fake-vmm-{handle}", os.MFD_CLOEXEC)
        self.fds[fd] = phys
        st = os.fstat(fd)
        self.exports[st.st_dev, st.st_ino] = phys
        self._log("mem_export_fd", handle, fd)
        return fd

    def forget_closed_fds(self) -> None:
        """Drop exported fds their owner has closed (the fake cannot see close(2))."""
        for fd in list(self.fds):
            try:
                os.fstat(fd)
            except OSError:
                del self.fds[fd]

    def mem_import_fd(self, fd: int) -> MemHandle:
        self._need_device("cuMemImportFromShareableHandle")
        try:
            st = os.fstat(fd)
        except OSError:
            phys = None
        else:
            phys = self.exports.get((st.st_dev, st.st_ino))
        if phys is None:
            raise fail("cuMemImportFromShareableHandle", INVALID_VALUE)
        handle = next(self._ids)
        phys.handles += 1
        self.handles[handle] = phys
        self._log("mem_import_fd", fd, handle)
        return MemHandle(handle)

    def mem_release(self, handle: MemHandle) -> None:
        phys = self.handles.pop(handle, None)
        if phys is None:
            raise fail("cuMemRelease", INVALID_VALUE)
        phys.handles -= 1
        self._log("mem_release", handle)

    def address_reserve(self, size: int, alignment: int) -> DevicePtr:
        self._need_device("cuMemAddressReserve")
        if size <= 0 or size % self._granularity or alignment & (alignment - 1):
            raise fail("cuMemAddressReserve", INVALID_VALUE)
        base = self._new_va(size, alignment)
        self.reserved[base] = size
        self._log("address_reserve", base, size)
        return DevicePtr(base)

    def address_free(self, ptr: DevicePtr, size: int) -> None:
        if self.reserved.get(ptr) != size:
            raise fail("cuMemAddressFree", INVALID_VALUE)
        if any(ptr <= a < ptr + size for a in self.mappings):
            raise fail("cuMemAddressFree", INVALID_VALUE)  # still mapped
        del self.reserved[ptr]
        self._log("address_free", ptr, size)

    def mem_map(self, ptr: DevicePtr, size: int, handle: MemHandle) -> None:
        """The first `size` bytes of the allocation at `ptr`: a granularity-aligned part of a
        live handle, inside a reserved range, over no other mapping."""
        phys = self.handles.get(handle)
        inside = any(b <= ptr and ptr + size <= b + n for b, n in self.reserved.items())
        overlaps = any(ptr < b + m.size and b < ptr + size for b, m in self.mappings.items())
        g = self._granularity
        aligned = not (ptr % g or size % g)
        fits = phys is not None and 0 < size <= phys.size
        if phys is None or not (fits and inside and aligned) or overlaps:
            raise fail("cuMemMap", INVALID_VALUE)
        self.mappings[ptr] = Mapping(size, phys)
        self._log("mem_map", ptr, size, handle)

    def mem_unmap(self, ptr: DevicePtr, size: int) -> None:
        at, end, covered = ptr, ptr + size, []
        while at < end:
            m = self.mappings.get(at)
            if m is None or at + m.size > end:
                raise fail("cuMemUnmap", INVALID_VALUE)
            covered.append(at)
            at += m.size
        for base in covered:
            del self.mappings[base]
        self._log("mem_unmap", ptr, size)

    def set_access(self, ptr: DevicePtr, size: int) -> None:
        at, end, covered = ptr, ptr + size, []
        while at < end:
            m = self.mappings.get(at)
            if m is None or at + m.size > end:
                raise fail("cuMemSetAccess", INVALID_VALUE)  # not fully mapped
            covered.append(m)
            at += m.size
        for m in covered:
            m.access = True
        self._log("set_access", ptr, size)

    # -- plain allocations and legacy IPC ---------------------------------------------------
    def mem_alloc(self, size: int) -> DevicePtr:
        self._need_device("cuMemAlloc")
        phys = Phys(size, False)
        base = self._new_va(size, self._granularity)
        self.allocs[base] = phys
        self.mappings[base] = Mapping(size, phys, access=True)
        self._log("mem_alloc", base, size)
        return DevicePtr(base)

    def mem_free(self, ptr: DevicePtr) -> None:
        if ptr not in self.allocs:
            raise fail("cuMemFree", INVALID_VALUE)
        del self.allocs[ptr], self.mappings[ptr]
        self._log("mem_free", ptr)

    def ipc_get_handle(self, ptr: DevicePtr) -> bytes:
        if ptr not in self.allocs:
            raise fail("cuIpcGetMemHandle", INVALID_VALUE)
        return b"FAKEIPC:" + ptr.to_bytes(8, "little") + bytes(48)

    def ipc_open_handle(self, handle: bytes) -> DevicePtr:
        base = int.from_bytes(handle[8:16], "little")
        phys = self._peer_allocs.get(base)  # a handle opens in another process only
        if len(handle) != 64 or not handle.startswith(b"FAKEIPC:") or phys is None:
            raise fail("cuIpcOpenMemHandle", INVALID_HANDLE)
        at = self._new_va(phys.size, self._granularity)
        self.ipc_opened[at] = phys
        self.mappings[at] = Mapping(phys.size, phys, access=True)
        self._log("ipc_open_handle", at)
        return DevicePtr(at)

    def ipc_close_handle(self, ptr: DevicePtr) -> None:
        if ptr not in self.ipc_opened:
            raise fail("cuIpcCloseMemHandle", INVALID_VALUE)
        del self.ipc_opened[ptr], self.mappings[ptr]
        self._log("ipc_close_handle", ptr)

    # -- host memory and copies ---------------------------------------------------------------
    def host_register(self, address: int, size: int) -> None:
        if any(address < a + n and a < address + size for a, n in self.registered.items()):
            raise fail("cuMemHostRegister", HOST_ALREADY_REGISTERED)
        ctypes.string_at(address, size)  # the range must be readable host memory
        self.registered[address] = size
        self._log("host_register", address, size)

    def host_unregister(self, address: int) -> None:
        if self.registered.pop(address, None) is None:
            raise fail("cuMemHostUnregister", HOST_NOT_REGISTERED)
        self._log("host_unregister", address)

    def memset_d8_async(self, ptr: DevicePtr, value: int, size: int, stream: StreamHandle) -> None:
        self._segments("cuMemsetD8Async", ptr, size)
        self._log("memset", ptr, value, size, stream)

        def work() -> bool:
            self.write(ptr, bytes([value]) * size, "cuMemsetD8Async")
            return True

        self._enqueue("cuMemsetD8Async", stream, work)

    def memcpy_htod(self, dst: DevicePtr, src: int, size: int) -> None:
        self.write(dst, ctypes.string_at(src, size), "cuMemcpyHtoD")

    def memcpy_dtoh(self, dst: int, src: DevicePtr, size: int) -> None:
        ctypes.memmove(dst, self.read(src, size, "cuMemcpyDtoH"), size)

    def _copy_done(self, direction: str, size: int, host: int) -> None:
        self.now_ns += size / self.gbps[direction]
        self.copies.append((direction, size, self._pinned(host, size)))

    def memcpy_htod_async(self, dst: DevicePtr, src: int, size: int, stream: StreamHandle) -> None:
        self._segments("cuMemcpyHtoDAsync", dst, size)
        self._log("htod", dst, src, size, stream)

        def work() -> bool:
            self.write(dst, ctypes.string_at(src, size), "cuMemcpyHtoDAsync")
            self._copy_done("h2d", size, src)
            return True

        self._enqueue("cuMemcpyHtoDAsync", stream, work)

    def memcpy_dtoh_async(self, dst: int, src: DevicePtr, size: int, stream: StreamHandle) -> None:
        self._segments("cuMemcpyDtoHAsync", src, size)
        self._log("dtoh", dst, src, size, stream)

        def work() -> bool:
            ctypes.memmove(dst, self.read(src, size, "cuMemcpyDtoHAsync"), size)
            self._copy_done("d2h", size, dst)
            return True

        self._enqueue("cuMemcpyDtoHAsync", stream, work)

    # -- streams and events ---------------------------------------------------------------
    def stream_create(self) -> StreamHandle:
        self._need_device("cuStreamCreate")
        stream = next(self._ids)
        self.streams[stream] = deque()
        self._log("stream_create", stream)
        return StreamHandle(stream)

    def stream_destroy(self, stream: StreamHandle) -> None:
        if stream == 0 or stream not in self.streams:
            raise fail("cuStreamDestroy", INVALID_HANDLE)
        self._drain("cuStreamDestroy", stream)
        del self.streams[stream]
        self._log("stream_destroy", stream)

    def _drain(self, call: str, stream: int) -> None:
        self.run_all()
        if self.streams[stream]:
            raise AssertionError(f"{call}: stream {stream} waits forever (a wait never met)")

    def stream_synchronize(self, stream: StreamHandle) -> None:
        if stream not in self.streams:
            raise fail("cuStreamSynchronize", INVALID_HANDLE)
        self._drain("cuStreamSynchronize", stream)
        self._log("stream_synchronize", stream)

    def stream_wait_event(self, stream: StreamHandle, event: EventHandle) -> None:
        e = self._event("cuStreamWaitEvent", event)
        self._log("stream_wait_event", stream, event)
        if not e.recorded:
            return  # waiting on a never-recorded event is a no-op
        self._enqueue("cuStreamWaitEvent", stream, lambda: e.done)

    def launch_host_func(self, stream: StreamHandle, fn: Callable[[], None]) -> None:
        self._log("launch_host_func", stream)

        def work() -> bool:
            fn()
            return True

        self._enqueue("cuLaunchHostFunc", stream, work)

    def event_create(self, *, timing: bool) -> EventHandle:
        self._need_device("cuEventCreate")
        event = next(self._ids)
        self.events[event] = Event(timing)
        self._log("event_create", event)
        return EventHandle(event)

    def event_destroy(self, event: EventHandle) -> None:
        if self.events.pop(event, None) is None:
            raise fail("cuEventDestroy", INVALID_HANDLE)
        self._log("event_destroy", event)

    def event_record(self, event: EventHandle, stream: StreamHandle) -> None:
        e = self._event("cuEventRecord", event)
        e.recorded, e.done = True, False
        self._log("event_record", event, stream)

        def work() -> bool:
            e.done, e.time_ns = True, self.now_ns
            return True

        self._enqueue("cuEventRecord", stream, work)

    def event_query(self, event: EventHandle) -> bool:
        return self._event("cuEventQuery", event).done

    def event_synchronize(self, event: EventHandle) -> None:
        e = self._event("cuEventSynchronize", event)
        self.run_all()
        if not e.done:
            raise AssertionError("cuEventSynchronize: the event never completes")

    def event_elapsed_ms(self, start: EventHandle, end: EventHandle) -> float:
        a, b = self._event("cuEventElapsedTime", start), self._event("cuEventElapsedTime", end)
        if not (a.timing and b.timing):
            raise fail("cuEventElapsedTime", INVALID_HANDLE)
        if not (a.recorded and b.recorded and a.done and b.done):
            raise fail("cuEventElapsedTime", NOT_READY)
        return (b.time_ns - a.time_ns) / 1e6


class FakeNvml:
    """An `Nvml` for one GPU with fixed numbers."""

    def __init__(
        self,
        *,
        name: str = "NVIDIA H100 80GB HBM3",
        total: int = 80 << 30,
        free: int = 79 << 30,
        generation: int = 5,
        width: int = 16,
        current_generation: int = 1,
    ) -> None:
        self.name = name
        self.total = total
        self.free = free
        self.generation = generation
        self.width = width
        self.current_generation = current_generation
        self.opened: str | None = None
        self.closed = False
        self.fail_memory = False

    def open(self, pci_bus_id: str) -> None:
        self.opened = pci_bus_id

    def facts(self) -> DeviceFacts:
        assert self.opened is not None and not self.closed
        return DeviceFacts(
            self.name,
            self.total,
            self.free,
            self.generation,
            self.width,
            self.current_generation,
            self.width,
        )

    def memory(self) -> tuple[int, int]:
        if self.fail_memory:
            raise NvmlError("nvmlDeviceGetMemoryInfo", "GPU is lost")
        return self.total, self.free

    def close(self) -> None:
        assert self.opened is not None and not self.closed
        self.closed = True
