"""Mapping a granted lease for the backend the daemon serves.

    grant ─┬─ sim   device: ChunkMapping(device fds)          host: ChunkMapping(host fds)
           └─ cuda  driver opened on the daemon's GPU, found by the lease's PCI bus id
                    device, vmm: CudaDeviceMapping(device fds)   (a session's chunks only)
                    device, ipc: IpcDeviceMapping(ipc handle, consecutive chunks)
                    host:        PinnedChunkMapping(host fds), page-locked

The fds stay the caller's: it closes them once this returns (the mappings hold the memory).
Everything made here is undone when a later step fails. Importing this module loads no CUDA
library; a cuda lease constructs the real driver only when no `driver` is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tidalcore.chunks import ChunkMapping

from tidalclient.errors import AttachError
from tidalclient.handles import Grant

if TYPE_CHECKING:
    from tidalcore.cuda_driver import Driver


class DeviceLease(Protocol):
    """A mapped device lease: `length` bytes from `address`; `retire` gives them back, and
    puts `keep`'s bytes ((offset, bytes): arrays the job still holds, read before the daemon
    scrubs the chunks) back at their offsets in memory of this process where the mapping can
    (sim, cuda "vmm"; cuda "ipc" cannot, and says so)."""

    address: int
    length: int

    def read(self, offset: int, nbytes: int) -> bytes:
        """The bytes [offset, offset + nbytes) of the lease (a synchronous copy)."""
        ...

    def retire(self, keep: Sequence[tuple[int, bytes]] = ()) -> None: ...


class HostLease(Protocol):
    """A mapped host lease, readable and writable from this process; `retire` as a device
    lease's."""

    address: int
    length: int

    def buffer(self, offset: int, nbytes: int) -> memoryview: ...

    def retire(self, keep: Sequence[tuple[int, bytes]] = ()) -> None: ...


@dataclass(frozen=True, slots=True)
class CudaLease:
    """What a session on the cuda backend holds besides its mappings."""

    driver: Driver  # its primary context is current on every thread that calls it
    ordinal: int  # the daemon's GPU as this process numbers it (CUDA_VISIBLE_DEVICES)
    pci_bus_id: str
    mode: str  # "vmm" or "ipc"


@dataclass(frozen=True, slots=True)
class MappedLease:
    backend: str  # "sim" or "cuda"
    device: DeviceLease
    host: HostLease
    cuda: CudaLease | None = None  # None on sim


def map_grant(grant: Grant, driver: Driver | None = None) -> MappedLease:
    """Map both pools of `grant` as its backend wants; AttachError names what failed."""
    lease = grant.response.lease
    if lease.backend == "sim":
        return _map_sim(grant)
    if lease.backend == "cuda":
        return _map_cuda(grant, driver)
    raise AttachError(
        f"the daemon serves the {lease.backend!r} backend (mode {lease.mode!r}); this client"
        " maps sim and cuda leases"
    )


def _map_sim(grant: Grant) -> MappedLease:
    lease = grant.response.lease
    device = ChunkMapping(grant.device_fds, lease.device.chunk_bytes)
    try:
        host = ChunkMapping(grant.host_fds, lease.host.chunk_bytes)
    except OSError:
        device.retire()
        raise
    return MappedLease("sim", device, host)


def _map_cuda(grant: Grant, driver: Driver | None) -> MappedLease:
    from tidalcore.chunks import PinnedChunkMapping
    from tidalcore.cuda_driver import CudaDriver, CudaError

    from tidalclient.devices.cuda import CudaDeviceMapping, IpcDeviceMapping

    lease = grant.response.lease
    if lease.mode not in ("vmm", "ipc"):
        raise AttachError(f"the cuda daemon shares device memory by {lease.mode!r}, not vmm or ipc")
    if not lease.pci_bus_id:
        raise AttachError("the cuda daemon did not name its GPU's PCI bus id in the lease")
    if driver is None:
        try:
            driver = CudaDriver()
        except ImportError as e:
            raise AttachError(
                f"the daemon serves the cuda backend, but cuda-bindings cannot be loaded ({e}):"
                " pip install 'tidalpool[cuda]'"
            ) from e
    bus = lease.pci_bus_id
    try:
        ordinal = driver.device_by_pci_bus_id(bus)
    except CudaError as e:
        raise AttachError(
            f"the daemon's GPU {bus} is not visible to this process ({e}): check"
            " CUDA_VISIBLE_DEVICES"
        ) from e
    with contextlib.ExitStack() as undo:
        try:
            driver.open_device(ordinal)
            undo.callback(driver.close_device)
            device: DeviceLease
            chunk = lease.device.chunk_bytes
            if lease.mode == "vmm":
                granularity = driver.granularity(exportable=True)
                vmm = CudaDeviceMapping(driver, grant.device_fds, chunk, granularity)
                undo.callback(vmm.close)
                device = vmm
            else:
                ipc = IpcDeviceMapping.for_chunks(
                    driver, grant.response.ipc_handle, list(lease.device.chunks), chunk
                )
                undo.callback(ipc.retire)
                device = ipc
            host = PinnedChunkMapping(driver, grant.host_fds, lease.host.chunk_bytes)
        except (CudaError, OSError, ValueError) as e:
            raise AttachError(f"cannot map the cuda lease on GPU {bus} ({lease.mode}): {e}") from e
        undo.pop_all()
    return MappedLease("cuda", device, host, CudaLease(driver, ordinal, bus, lease.mode))
