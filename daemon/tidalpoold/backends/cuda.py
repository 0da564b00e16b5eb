"""The cuda backend: the device pool in GPU memory, the host pool pinned, NVML facts.

At start, in this order (each step undone in reverse by `close`, or at once if a later one
fails):

    open the device (primary context) ─▶ NVML facts ─▶ refuse a pool beyond free memory
    ─▶ device pool, "vmm": n chunks by cuMemCreate, each exported as a POSIX fd; the daemon
       maps them all contiguously (to scrub them)
       or "ipc" (fd export not supported, or asked for): one cuMemAlloc, its legacy IPC handle;
       chunk i at offset i*chunk. Every session opening it can reach the whole pool
    ─▶ host pool: one memfd per chunk, mapped contiguously here and page-locked
    ─▶ bandwidth probe: pinned host → device and back on two non-default streams
    ─▶ zero the device pool and the probed host bytes: the first holders read zeros

In "vmm" mode a client receives only its own chunks' fds, so it can reach no other session's
device memory. A returned chunk is scrubbed with a memset (device) or zeroed in place (host:
its pages stay pinned, so punching holes would free nothing).
"""

from __future__ import annotations

import contextlib
import os
import resource

from tidalcore.chunks import PinnedChunkMapping
from tidalcore.cuda_driver import (
    CUDA_ERROR_NOT_PERMITTED,
    CUDA_ERROR_NOT_SUPPORTED,
    CudaDriver,
    CudaError,
    DeviceFacts,
    DevicePtr,
    Driver,
    EventHandle,
    MemHandle,
    Nvml,
    NvmlError,
    PyNvml,
    StreamHandle,
)
from tidalcore.units import format_size

from tidalpoold.backends.bandwidth import (
    NOT_MEASURED,
    PROBE_BYTES,
    PROBE_TOTAL,
    Bandwidth,
    gbps,
    repeats_for,
)
from tidalpoold.backends.base import Chunk, Pool
from tidalpoold.backends.memfd import memfd_chunks

MODES = ("auto", "vmm", "ipc")
_FD_SLACK = 256  # fds the daemon needs besides its chunks (sockets, logs, gRPC)

# Export failures that mean "this environment cannot share VMM memory by fd" (containers
# without the capability, drivers or devices without POSIX fd handles): fall back to ipc.
_NO_EXPORT = (CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_NOT_PERMITTED)


class CudaBackendError(RuntimeError):
    """The cuda backend refuses to start; the message names the numbers and what to change."""


def _size(nbytes: int) -> str:
    return f"{format_size(nbytes)} ({nbytes} bytes)"


def open_gpu(driver: Driver | None, gpu: int) -> Driver:
    """`driver` (the real one when None) with GPU `gpu` open. Where the CUDA driver library
    cannot be loaded (no NVIDIA driver: a machine without a GPU) or the GPU cannot be opened,
    a `CudaBackendError` says so in one line and names the sim backend."""
    try:
        driver = driver if driver is not None else CudaDriver()
        driver.open_device(gpu)
    except CudaError as e:
        raise CudaBackendError(
            f"cannot open GPU {gpu} ({e}): without a GPU, use --backend sim"
        ) from e
    except (ImportError, OSError, RuntimeError) as e:  # cuda-bindings' loader: libcuda missing
        why = " ".join(str(e).split()) or type(e).__name__
        raise CudaBackendError(
            f"the CUDA driver library cannot be loaded ({why}): without a GPU, use --backend sim"
        ) from e
    return driver


def check_chunk(chunk_bytes: int, granularity: int) -> None:
    """A device chunk must be a whole number of allocation granules (cuMemCreate's rule)."""
    if granularity <= 0:
        raise CudaBackendError(f"the GPU reports an allocation granularity of {granularity}")
    if chunk_bytes <= 0 or chunk_bytes % granularity:
        down = chunk_bytes // granularity * granularity
        up = down + granularity
        nearest = _size(up) if down == 0 else f"{_size(down)} or {_size(up)}"
        raise CudaBackendError(
            f"chunk size {_size(chunk_bytes)} is not a multiple of the GPU's allocation"
            f" granularity {_size(granularity)}; use {nearest}"
        )


def check_fits(device_bytes: int, facts: DeviceFacts, gpu: int) -> None:
    """Refuse a device pool larger than the GPU's free memory, with both numbers."""
    if device_bytes > facts.free_bytes:
        raise CudaBackendError(
            f"device pool of {_size(device_bytes)} does not fit on GPU {gpu} ({facts.name}):"
            f" {_size(facts.free_bytes)} free of {_size(facts.total_bytes)}"
        )


def probe_bandwidth(
    driver: Driver, device: DevicePtr, host: int, span: int, repeats: int
) -> Bandwidth:
    """Copy `span` bytes `repeats` times host → device on one non-default stream, then
    device → host on another, each timed by a pair of events (after one untimed warm-up copy
    each way). `host` must be page-locked."""
    if span <= 0 or repeats <= 0:
        raise ValueError(f"probe of {repeats} copies of {span} bytes")
    with contextlib.ExitStack() as undo:
        streams: list[StreamHandle] = []
        for _ in range(2):
            streams.append(driver.stream_create())
            undo.callback(driver.stream_destroy, streams[-1])
        events: list[EventHandle] = []
        for _ in range(4):
            events.append(driver.event_create(timing=True))
            undo.callback(driver.event_destroy, events[-1])
        h2d, d2h = streams
        driver.memcpy_htod_async(device, host, span, h2d)
        driver.memcpy_dtoh_async(host, device, span, d2h)
        driver.stream_synchronize(h2d)
        driver.stream_synchronize(d2h)
        driver.event_record(events[0], h2d)
        for _ in range(repeats):
            driver.memcpy_htod_async(device, host, span, h2d)
        driver.event_record(events[1], h2d)
        driver.event_synchronize(events[1])
        driver.event_record(events[2], d2h)
        for _ in range(repeats):
            driver.memcpy_dtoh_async(host, device, span, d2h)
        driver.event_record(events[3], d2h)
        driver.event_synchronize(events[3])
        moved = span * repeats
        return Bandwidth(
            h2d_gbps=gbps(moved, driver.event_elapsed_ms(events[0], events[1])),
            d2h_gbps=gbps(moved, driver.event_elapsed_ms(events[2], events[3])),
            bytes_each_way=moved,
        )


def ensure_fd_limit(needed: int) -> None:
    """Raise the soft RLIMIT_NOFILE to `needed` (one fd a chunk), or say why it cannot be."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise CudaBackendError(
            f"the pools need {needed} file descriptors (one a chunk) but the hard limit is"
            f" {hard}: use a larger chunk size or raise LimitNOFILE"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


class CudaBackend:
    """The device pool on GPU `gpu`, the pinned host pool, and what NVML and the probe say.

    `mode` is "auto" (vmm if fds can be exported, else ipc), "vmm" (fail rather than fall
    back) or "ipc". `probe_bytes` 0 skips the bandwidth probe (its facts are then 0.0).
    `driver` and `nvml` default to the real ones (cuda-bindings, nvidia-ml-py).
    """

    name = "cuda"

    def __init__(
        self,
        device_bytes: int,
        host_bytes: int,
        chunk_bytes: int,
        gpu: int = 0,
        *,
        mode: str = "auto",
        probe_bytes: int = PROBE_BYTES,
        probe_total: int = PROBE_TOTAL,
        driver: Driver | None = None,
        nvml: Nvml | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"cuda mode must be one of {', '.join(MODES)}, got {mode!r}")
        if chunk_bytes <= 0:
            raise CudaBackendError(f"chunk size must be positive, got {chunk_bytes}")
        for what, total in (("device", device_bytes), ("host", host_bytes)):
            if total <= 0 or total % chunk_bytes:
                raise CudaBackendError(
                    f"{what} pool of {_size(total)} is not a whole number of"
                    f" {_size(chunk_bytes)} chunks"
                )
        self.gpu = gpu
        self.pci_bus_id = ""  # set once the device is open
        self.chunk_bytes = chunk_bytes
        self.granularity = 0
        self.bandwidth = NOT_MEASURED
        self._undo = contextlib.ExitStack()
        try:
            self._start(device_bytes, host_bytes, mode, probe_bytes, probe_total, driver, nvml)
        except BaseException:
            self._undo.close()
            raise

    # -- start ----------------------------------------------------------------------------
    def _start(
        self,
        device_bytes: int,
        host_bytes: int,
        mode: str,
        probe_bytes: int,
        probe_total: int,
        driver: Driver | None,
        nvml: Nvml | None,
    ) -> None:
        undo = self._undo
        self._driver = driver = open_gpu(driver, self.gpu)
        undo.callback(driver.close_device)
        self.pci_bus_id = driver.pci_bus_id()
        self._nvml = nvml = nvml if nvml is not None else PyNvml()
        nvml.open(self.pci_bus_id)
        undo.callback(nvml.close)
        self.start_facts = nvml.facts()
        check_fits(device_bytes, self.start_facts, self.gpu)
        n_device, n_host = device_bytes // self.chunk_bytes, host_bytes // self.chunk_bytes
        ensure_fd_limit(n_device + n_host + _FD_SLACK)

        first = self._choose_mode(mode)
        if self.mode == "vmm":
            device_chunks = self._make_vmm(n_device, first)
            ipc_handle = b""
        else:
            device_chunks, ipc_handle = self._make_ipc(n_device)
        self.device = Pool("device", self.chunk_bytes, device_chunks, ipc_handle)
        self._scrub_stream = driver.stream_create()
        undo.callback(driver.stream_destroy, self._scrub_stream)

        host_chunks = memfd_chunks("host", self.chunk_bytes, n_host)
        undo.callback(_close_fds, host_chunks)
        self.host = Pool("host", self.chunk_bytes, host_chunks)
        self._host_map = PinnedChunkMapping(driver, [c.fd for c in host_chunks], self.chunk_bytes)
        undo.callback(self._host_map.close)

        span = min(probe_bytes, device_bytes, host_bytes)
        if span > 0:
            repeats = repeats_for(span, probe_total)
            self.bandwidth = probe_bandwidth(
                driver, self._device_base, self._host_map.address, span, repeats
            )
            self._host_map.zero(0, span)
        self._memset(self._device_base, device_bytes)

    def _choose_mode(self, asked: str) -> MemHandle | None:
        """Set `mode` and `mode_reason`; in vmm mode, return the first chunk (made and
        exported, proving that export works), its fd in `_first_fd`."""
        driver = self._driver
        if asked == "ipc":
            self.mode, self.mode_reason = "ipc", "ipc mode asked for: no isolation between sessions"
            return None
        if not driver.vmm_supported():
            why = "the GPU does not support virtual memory management with POSIX fd handles"
            self._fall_back(asked, why)
            return None
        self.granularity = driver.granularity(exportable=True)
        check_chunk(self.chunk_bytes, self.granularity)
        handle = driver.mem_create(self.chunk_bytes, exportable=True)
        try:
            self._first_fd = driver.mem_export_fd(handle)
        except CudaError as e:
            driver.mem_release(handle)
            if e.code not in _NO_EXPORT:
                raise
            self._fall_back(asked, f"exporting a chunk as an fd failed: {e}")
            return None
        self.mode = "vmm"
        self.mode_reason = (
            f"vmm: each {_size(self.chunk_bytes)} chunk exported as its own fd;"
            " a session maps only its own chunks"
        )
        return handle

    def _fall_back(self, asked: str, why: str) -> None:
        if asked == "vmm":
            raise CudaBackendError(f"vmm mode asked for, but {why}")
        self.mode = "ipc"
        self.mode_reason = f"ipc fallback (no isolation between sessions): {why}"

    def _make_vmm(self, count: int, first: MemHandle | None) -> tuple[Chunk, ...]:
        driver, undo, size = self._driver, self._undo, self.chunk_bytes
        assert first is not None
        handles = [first]
        undo.callback(driver.mem_release, first)
        undo.callback(os.close, self._first_fd)
        fds = [self._first_fd]
        for _ in range(1, count):
            handles.append(driver.mem_create(size, exportable=True))
            undo.callback(driver.mem_release, handles[-1])
            fds.append(driver.mem_export_fd(handles[-1]))
            undo.callback(os.close, fds[-1])
        total = count * size
        self._device_base = base = driver.address_reserve(total, self.granularity)
        undo.callback(driver.address_free, base, total)
        for k, handle in enumerate(handles):
            driver.mem_map(DevicePtr(base + k * size), size, handle)
            undo.callback(driver.mem_unmap, DevicePtr(base + k * size), size)
        driver.set_access(base, total)
        return tuple(Chunk(k, fd, size) for k, fd in enumerate(fds))

    def _make_ipc(self, count: int) -> tuple[tuple[Chunk, ...], bytes]:
        driver = self._driver
        self._device_base = base = driver.mem_alloc(count * self.chunk_bytes)
        self._undo.callback(driver.mem_free, base)
        handle = driver.ipc_get_handle(base)
        return tuple(Chunk(k, -1, self.chunk_bytes) for k in range(count)), handle

    def _memset(self, ptr: DevicePtr, nbytes: int) -> None:
        self._driver.memset_d8_async(ptr, 0, nbytes, self._scrub_stream)
        self._driver.stream_synchronize(self._scrub_stream)

    # -- the Backend interface ----------------------------------------------------------------
    def scrub(self, pool: Pool, chunk: Chunk) -> None:
        """Zero a returned chunk before anyone else can lease it."""
        if pool is not self.device and pool is not self.host:
            raise ValueError(f"pool {pool.name!r} is not one of this backend's pools")
        if not 0 <= chunk.index < len(pool.chunks) or pool.chunks[chunk.index] != chunk:
            raise ValueError(f"chunk {chunk.index} is not a chunk of the {pool.name} pool")
        offset = chunk.index * pool.chunk_bytes
        if pool is self.device:
            self._memset(DevicePtr(self._device_base + offset), pool.chunk_bytes)
        else:
            self._host_map.zero(offset, pool.chunk_bytes)

    def facts(self) -> dict[str, str | int | float]:
        f = self.start_facts
        try:
            total, free = self._nvml.memory()
        except NvmlError:
            total, free = f.total_bytes, f.free_bytes
        return {
            "device": f.name,
            "gpu": self.gpu,
            "pci_bus_id": self.pci_bus_id,
            "mode": self.mode,
            "total_bytes": total,
            "free_bytes": free,
            "chunk_bytes": self.chunk_bytes,
            "granularity_bytes": self.granularity,
            "pcie_generation": f.pcie_generation,
            "pcie_width": f.pcie_width,
            "h2d_gbps": round(self.bandwidth.h2d_gbps, 2),
            "d2h_gbps": round(self.bandwidth.d2h_gbps, 2),
        }

    def close(self) -> None:
        """Release everything in the reverse order of its making. Idempotent."""
        self._undo.close()


def _close_fds(chunks: tuple[Chunk, ...]) -> None:
    for chunk in reversed(chunks):
        with contextlib.suppress(OSError):
            os.close(chunk.fd)
