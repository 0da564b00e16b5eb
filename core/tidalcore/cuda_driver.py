"""A thin, typed face of the CUDA driver API and of NVML, for both halves of the cuda backend.

Everything CUDA or NVML that tidalpool does goes through two small protocols, `Driver` and
`Nvml`, so that the logic around them is tested on CPU against fakes. The real implementations,
`CudaDriver` (cuda-bindings' `cuda.bindings.driver`) and `PyNvml` (nvidia-ml-py), import their
modules only when constructed: importing this module needs neither. Every CUresult is checked;
a failure is a `CudaError` naming the call and the CUDA error name.

Handles cross the protocol as plain integers (`DevicePtr`, `MemHandle`, `StreamHandle`,
`EventHandle`), so fakes and tests need no CUDA types.
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NewType, Protocol

DevicePtr = NewType("DevicePtr", int)  # a device virtual address (CUdeviceptr)
MemHandle = NewType("MemHandle", int)  # a physical allocation (CUmemGenericAllocationHandle)
StreamHandle = NewType("StreamHandle", int)  # a CUstream; 0 is the legacy default stream
EventHandle = NewType("EventHandle", int)  # a CUevent

IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)

# CUresult values the callers look at (from cuda.h; stable across CUDA versions).
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801


class CudaError(RuntimeError):
    """A driver call failed: `call` is the function, `code`/`error` the CUresult."""

    def __init__(self, call: str, code: int, error: str) -> None:
        self.call = call
        self.code = code
        self.error = error
        super().__init__(f"{call} failed: {error} ({code})")


class NvmlError(RuntimeError):
    """An NVML call failed: `call` is the function."""

    def __init__(self, call: str, detail: str) -> None:
        self.call = call
        super().__init__(f"{call} failed: {detail}")


class Driver(Protocol):
    """The driver calls tidalpool makes. Sizes and offsets in bytes."""

    def open_device(self, ordinal: int) -> None:
        """cuInit, then retain the device's primary context and make it current."""
        ...

    def close_device(self) -> None:
        """Release the primary context retained by `open_device`."""
        ...

    def device_by_pci_bus_id(self, bus_id: str) -> int:
        """cuInit, then cuDeviceGetByPCIBusId: the ordinal of that GPU in this process, which
        CUDA_VISIBLE_DEVICES may number differently from another process (or hide)."""
        ...

    def pci_bus_id(self) -> str:
        """The open device's PCI bus id, "0000:3B:00.0" (to find it in NVML)."""
        ...

    def vmm_supported(self) -> bool:
        """Whether the device does virtual memory management with POSIX fd handles."""
        ...

    # -- virtual memory management ------------------------------------------------------
    def granularity(self, *, exportable: bool) -> int:
        """cuMemGetAllocationGranularity (minimum) of a device allocation."""
        ...

    def mem_create(self, size: int, *, exportable: bool) -> MemHandle:
        """cuMemCreate on the open device; `exportable` asks for a POSIX fd handle type."""
        ...

    def mem_export_fd(self, handle: MemHandle) -> int:
        """cuMemExportToShareableHandle as a POSIX fd (owned by the caller)."""
        ...

    def mem_import_fd(self, fd: int) -> MemHandle:
        """cuMemImportFromShareableHandle of a POSIX fd (the fd stays the caller's)."""
        ...

    def mem_release(self, handle: MemHandle) -> None: ...

    def address_reserve(self, size: int, alignment: int) -> DevicePtr: ...

    def address_free(self, ptr: DevicePtr, size: int) -> None: ...

    def mem_map(self, ptr: DevicePtr, size: int, handle: MemHandle) -> None:
        """cuMemMap of the first `size` bytes of `handle` at `ptr` (a multiple of the
        allocation granularity). From its first byte only: cuMemMap's offset "must be zero",
        and the driver 580.159.04 of an H200 answers CUDA_ERROR_NOT_SUPPORTED to any other."""
        ...

    def mem_unmap(self, ptr: DevicePtr, size: int) -> None: ...

    def set_access(self, ptr: DevicePtr, size: int) -> None:
        """cuMemSetAccess: read/write from the open device over a mapped range."""
        ...

    # -- plain allocations and legacy IPC -----------------------------------------------
    def mem_alloc(self, size: int) -> DevicePtr: ...

    def mem_free(self, ptr: DevicePtr) -> None: ...

    def ipc_get_handle(self, ptr: DevicePtr) -> bytes:
        """cuIpcGetMemHandle: the 64 bytes another process opens."""
        ...

    def ipc_open_handle(self, handle: bytes) -> DevicePtr: ...

    def ipc_close_handle(self, ptr: DevicePtr) -> None: ...

    # -- host memory, copies, streams, events -------------------------------------------
    def host_register(self, address: int, size: int) -> None:
        """cuMemHostRegister (portable): page-lock host memory for async copies."""
        ...

    def host_unregister(self, address: int) -> None: ...

    def memset_d8_async(
        self, ptr: DevicePtr, value: int, size: int, stream: StreamHandle
    ) -> None: ...

    def memcpy_htod(self, dst: DevicePtr, src: int, size: int) -> None:
        """Synchronous copy from host address `src`."""
        ...

    def memcpy_dtoh(self, dst: int, src: DevicePtr, size: int) -> None:
        """Synchronous copy to host address `dst`."""
        ...

    def memcpy_htod_async(
        self, dst: DevicePtr, src: int, size: int, stream: StreamHandle
    ) -> None: ...

    def memcpy_dtoh_async(
        self, dst: int, src: DevicePtr, size: int, stream: StreamHandle
    ) -> None: ...

    def stream_create(self) -> StreamHandle:
        """A non-blocking stream (no implicit sync with the legacy default stream)."""
        ...

    def stream_destroy(self, stream: StreamHandle) -> None: ...

    def stream_synchronize(self, stream: StreamHandle) -> None: ...

    def stream_wait_event(self, stream: StreamHandle, event: EventHandle) -> None: ...

    def launch_host_func(self, stream: StreamHandle, fn: Callable[[], None]) -> None:
        """cuLaunchHostFunc: run `fn` in stream order (it must not call CUDA)."""
        ...

    def event_create(self, *, timing: bool) -> EventHandle: ...

    def event_destroy(self, event: EventHandle) -> None: ...

    def event_record(self, event: EventHandle, stream: StreamHandle) -> None: ...

    def event_query(self, event: EventHandle) -> bool:
        """True once complete; False while not ready (CUDA_ERROR_NOT_READY)."""
        ...

    def event_synchronize(self, event: EventHandle) -> None: ...

    def event_elapsed_ms(self, start: EventHandle, end: EventHandle) -> float: ...


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """What NVML says about one GPU."""

    name: str
    total_bytes: int
    free_bytes: int
    pcie_generation: int  # the most the device and the system allow
    pcie_width: int
    pcie_current_generation: int  # now (drops while the link idles)
    pcie_current_width: int


class Nvml(Protocol):
    def open(self, pci_bus_id: str) -> None:
        """nvmlInit and find the device by PCI bus id (CUDA and NVML number GPUs differently)."""
        ...

    def facts(self) -> DeviceFacts: ...

    def memory(self) -> tuple[int, int]:
        """(total, free) bytes now."""
        ...

    def close(self) -> None: ...


def _hostfn_type() -> Any:
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class CudaDriver:
    """`Driver` over cuda-bindings. The primary context is made current on each thread that
    calls, so streams and finalizers may be used from any thread."""

    def __init__(self) -> None:
        self._cu: Any = importlib.import_module("cuda.bindings.driver")
        self._device: Any = None
        self._ordinal = -1
        self._context: Any = None
        self._local = threading.local()
        self._callbacks: dict[int, Any] = {}  # host functions in flight, kept alive
        self._callback_ids = 0
        self._lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------
    def _call(self, name: str, *args: Any) -> Any:
        """Run cu<name>(*args), check its CUresult; the other results (one, a tuple, or None)."""
        if self._context is not None and getattr(self._local, "context", None) is not self._context:
            self._raw("cuCtxSetCurrent", self._context)
            self._local.context = self._context
        return self._raw(name, *args)

    def _raw(self, name: str, *args: Any) -> Any:
        out = getattr(self._cu, name)(*args)
        result, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        code = int(result)
        if code != 0:
            raise CudaError(name, code, getattr(result, "name", f"CUresult {code}"))
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else rest

    def _ptr(self, ptr: int) -> Any:
        return self._cu.CUdeviceptr(ptr)

    def _stream(self, stream: int) -> Any:
        return self._cu.CUstream(stream)

    def _event(self, event: int) -> Any:
        return self._cu.CUevent(event)

    def _prop(self, exportable: bool) -> Any:
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self._ordinal
        if exportable:
            posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            prop.requestedHandleTypes = posix
        return prop

    # -- device -------------------------------------------------------------------------
    def open_device(self, ordinal: int) -> None:
        self._raw("cuInit", 0)
        self._device = self._raw("cuDeviceGet", ordinal)
        self._ordinal = ordinal
        self._context = self._raw("cuDevicePrimaryCtxRetain", self._device)
        self._raw("cuCtxSetCurrent", self._context)
        self._local.context = self._context

    def close_device(self) -> None:
        if self._context is None:
            return
        self._context = None
        self._raw("cuDevicePrimaryCtxRelease", self._device)

    def device_by_pci_bus_id(self, bus_id: str) -> int:
        self._raw("cuInit", 0)
        return int(self._raw("cuDeviceGetByPCIBusId", bus_id.encode()))

    def pci_bus_id(self) -> str:
        raw = self._call("cuDeviceGetPCIBusId", 32, self._device)
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return text.split("\x00", 1)[0]

    def vmm_supported(self) -> bool:
        attr = self._cu.CUdevice_attribute
        vmm = self._call(
            "cuDeviceGetAttribute",
            attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            self._device,
        )
        fd = self._call(
            "cuDeviceGetAttribute",
            attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            self._device,
        )
        return bool(vmm) and bool(fd)

    # -- virtual memory management ------------------------------------------------------
    def granularity(self, *, exportable: bool) -> int:
        minimum = self._cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self._call("cuMemGetAllocationGranularity", self._prop(exportable), minimum))

    def mem_create(self, size: int, *, exportable: bool) -> MemHandle:
        return MemHandle(int(self._call("cuMemCreate", size, self._prop(exportable), 0)))

    def mem_export_fd(self, handle: MemHandle) -> int:
        posix = self._cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        handle_obj = self._cu.CUmemGenericAllocationHandle(handle)
        return int(self._call("cuMemExportToShareableHandle", handle_obj, posix, 0))

    def mem_import_fd(self, fd: int) -> MemHandle:
        posix = self._cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return MemHandle(int(self._call("cuMemImportFromShareableHandle", fd, posix)))

    def mem_release(self, handle: MemHandle) -> None:
        self._call("cuMemRelease", self._cu.CUmemGenericAllocationHandle(handle))

    def address_reserve(self, size: int, alignment: int) -> DevicePtr:
        return DevicePtr(int(self._call("cuMemAddressReserve", size, alignment, self._ptr(0), 0)))

    def address_free(self, ptr: DevicePtr, size: int) -> None:
        self._call("cuMemAddressFree", self._ptr(ptr), size)

    def mem_map(self, ptr: DevicePtr, size: int, handle: MemHandle) -> None:
        handle_obj = self._cu.CUmemGenericAllocationHandle(handle)
        self._call("cuMemMap", self._ptr(ptr), size, 0, handle_obj, 0)

    def mem_unmap(self, ptr: DevicePtr, size: int) -> None:
        self._call("cuMemUnmap", self._ptr(ptr), size)

    def set_access(self, ptr: DevicePtr, size: int) -> None:
        cu = self._cu
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self._ordinal
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._call("cuMemSetAccess", self._ptr(ptr), size, [desc], 1)

    # -- plain allocations and legacy IPC -----------------------------------------------
    def mem_alloc(self, size: int) -> DevicePtr:
        return DevicePtr(int(self._call("cuMemAlloc", size)))

    def mem_free(self, ptr: DevicePtr) -> None:
        self._call("cuMemFree", self._ptr(ptr))

    def ipc_get_handle(self, ptr: DevicePtr) -> bytes:
        handle = self._call("cuIpcGetMemHandle", self._ptr(ptr))
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)

    def ipc_open_handle(self, handle: bytes) -> DevicePtr:
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        cu = self._cu
        obj = cu.CUipcMemHandle()
        ctypes.memmove(obj.getPtr(), handle, IPC_HANDLE_BYTES)
        lazy = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        return DevicePtr(int(self._call("cuIpcOpenMemHandle", obj, int(lazy))))

    def ipc_close_handle(self, ptr: DevicePtr) -> None:
        self._call("cuIpcCloseMemHandle", self._ptr(ptr))

    # -- host memory, copies --------------------------------------------------------------
    def host_register(self, address: int, size: int) -> None:
        self._call("cuMemHostRegister", address, size, self._cu.CU_MEMHOSTREGISTER_PORTABLE)

    def host_unregister(self, address: int) -> None:
        self._call("cuMemHostUnregister", address)

    def memset_d8_async(self, ptr: DevicePtr, value: int, size: int, stream: StreamHandle) -> None:
        self._call("cuMemsetD8Async", self._ptr(ptr), value, size, self._stream(stream))

    def memcpy_htod(self, dst: DevicePtr, src: int, size: int) -> None:
        self._call("cuMemcpyHtoD", self._ptr(dst), src, size)

    def memcpy_dtoh(self, dst: int, src: DevicePtr, size: int) -> None:
        self._call("cuMemcpyDtoH", dst, self._ptr(src), size)

    def memcpy_htod_async(self, dst: DevicePtr, src: int, size: int, stream: StreamHandle) -> None:
        self._call("cuMemcpyHtoDAsync", self._ptr(dst), src, size, self._stream(stream))

    def memcpy_dtoh_async(self, dst: int, src: DevicePtr, size: int, stream: StreamHandle) -> None:
        self._call("cuMemcpyDtoHAsync", dst, self._ptr(src), size, self._stream(stream))

    # -- streams and events -------------------------------------------------------------
    def stream_create(self) -> StreamHandle:
        flags = self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        return StreamHandle(int(self._call("cuStreamCreate", int(flags))))

    def stream_destroy(self, stream: StreamHandle) -> None:
        self._call("cuStreamDestroy", self._stream(stream))

    def stream_synchronize(self, stream: StreamHandle) -> None:
        self._call("cuStreamSynchronize", self._stream(stream))

    def stream_wait_event(self, stream: StreamHandle, event: EventHandle) -> None:
        self._call("cuStreamWaitEvent", self._stream(stream), self._event(event), 0)

    def launch_host_func(self, stream: StreamHandle, fn: Callable[[], None]) -> None:
        with self._lock:
            self._callback_ids += 1
            key = self._callback_ids

        def run(_user_data: int | None) -> None:
            try:
                fn()
            finally:
                self._callbacks.pop(key, None)

        callback = _hostfn_type()(run)
        self._callbacks[key] = callback  # alive until it has run
        address = ctypes.cast(callback, ctypes.c_void_p).value
        try:
            self._call("cuLaunchHostFunc", self._stream(stream), self._cu.CUhostFn(address), 0)
        except CudaError:
            self._callbacks.pop(key, None)
            raise

    def event_create(self, *, timing: bool) -> EventHandle:
        flags = self._cu.CUevent_flags
        value = flags.CU_EVENT_DEFAULT if timing else flags.CU_EVENT_DISABLE_TIMING
        return EventHandle(int(self._call("cuEventCreate", int(value))))

    def event_destroy(self, event: EventHandle) -> None:
        self._call("cuEventDestroy", self._event(event))

    def event_record(self, event: EventHandle, stream: StreamHandle) -> None:
        self._call("cuEventRecord", self._event(event), self._stream(stream))

    def event_query(self, event: EventHandle) -> bool:
        try:
            self._call("cuEventQuery", self._event(event))
        except CudaError as e:
            if e.code == CUDA_ERROR_NOT_READY:
                return False
            raise
        return True

    def event_synchronize(self, event: EventHandle) -> None:
        self._call("cuEventSynchronize", self._event(event))

    def event_elapsed_ms(self, start: EventHandle, end: EventHandle) -> float:
        return float(self._call("cuEventElapsedTime", self._event(start), self._event(end)))


class PyNvml:
    """`Nvml` over nvidia-ml-py (module `pynvml`)."""

    def __init__(self) -> None:
        self._nv: Any = importlib.import_module("pynvml")
        self._handle: Any = None

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._nv, name)(*args)
        except self._nv.NVMLError as e:
            raise NvmlError(name, str(e)) from e

    def open(self, pci_bus_id: str) -> None:
        self._call("nvmlInit")
        try:
            self._handle = self._call("nvmlDeviceGetHandleByPciBusId", pci_bus_id.encode())
        except NvmlError:
            self._call("nvmlShutdown")
            raise

    def memory(self) -> tuple[int, int]:
        info = self._call("nvmlDeviceGetMemoryInfo", self._handle)
        return int(info.total), int(info.free)

    def facts(self) -> DeviceFacts:
        name = self._call("nvmlDeviceGetName", self._handle)
        total, free = self.memory()
        h = self._handle
        return DeviceFacts(
            name=name.decode() if isinstance(name, bytes) else str(name),
            total_bytes=total,
            free_bytes=free,
            pcie_generation=int(self._call("nvmlDeviceGetMaxPcieLinkGeneration", h)),
            pcie_width=int(self._call("nvmlDeviceGetMaxPcieLinkWidth", h)),
            pcie_current_generation=int(self._call("nvmlDeviceGetCurrPcieLinkGeneration", h)),
            pcie_current_width=int(self._call("nvmlDeviceGetCurrPcieLinkWidth", h)),
        )

    def close(self) -> None:
        if self._handle is not None:
            self._handle = None
            self._call("nvmlShutdown")
