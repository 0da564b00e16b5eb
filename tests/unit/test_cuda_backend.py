"""The cuda backend's daemon half against the fake driver and NVML (tests/unit/fake_cuda.py)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
from tidalcore.cuda_driver import CudaError, DevicePtr
from tidalcore.units import Bytes
from tidalcore.v1 import pool_pb2
from tidalpoold.backends import SimBackend
from tidalpoold.backends import cuda as cuda_backend
from tidalpoold.backends.cuda import (
    Bandwidth,
    CudaBackend,
    CudaBackendError,
    check_chunk,
    ensure_fd_limit,
    gbps,
    probe_bandwidth,
)
from tidalpoold.sessions import Registry, lease_message
from tidalpoold.settings import Settings

from tests.unit.fake_cuda import NOT_SUPPORTED, FakeDriver, FakeNvml

KiB = 1024
GRAN = 64 * KiB
C = 2 * GRAN  # chunk


def start(
    driver: FakeDriver | None = None,
    nvml: FakeNvml | None = None,
    device_chunks: int = 4,
    host_chunks: int = 2,
    chunk: int = C,
    gpu: int = 0,
    mode: str = "auto",
    probe_bytes: int = 4 * C,
    probe_total: int = 8 * C,
) -> tuple[CudaBackend, FakeDriver, FakeNvml]:
    driver = driver or FakeDriver(granularity=GRAN)
    nvml = nvml or FakeNvml()
    backend = CudaBackend(
        device_chunks * chunk,
        host_chunks * chunk,
        chunk,
        gpu=gpu,
        mode=mode,
        probe_bytes=probe_bytes,
        probe_total=probe_total,
        driver=driver,
        nvml=nvml,
    )
    return backend, driver, nvml


def all_released(driver: FakeDriver, nvml: FakeNvml) -> bool:
    driver.forget_closed_fds()
    return nvml.closed and not any(driver.live().values())


# -- start in vmm mode ------------------------------------------------------------------------


def test_vmm_pool_is_one_exported_fd_per_chunk() -> None:
    backend, fake, nvml = start(gpu=1)
    assert (backend.name, backend.mode) == ("cuda", "vmm")
    assert "own chunks" in backend.mode_reason
    assert fake.ordinal == 1 and nvml.opened == fake.bus_id
    dev = backend.device
    assert (dev.name, dev.chunk_bytes, dev.total, dev.ipc_handle) == ("device", C, 4 * C, b"")
    assert [c.index for c in dev.chunks] == [0, 1, 2, 3]
    assert all(c.size == C for c in dev.chunks)
    # each chunk its own physical allocation, exported as its own fd
    assert len({c.fd for c in dev.chunks}) == 4
    assert len({id(fake.fds[c.fd]) for c in dev.chunks}) == 4
    assert all(fake.fds[c.fd].exportable and fake.fds[c.fd].size == C for c in dev.chunks)
    assert fake.names().count("mem_create") == 4
    # the daemon maps them all (to scrub) and sets access once over the whole range
    assert fake.names().count("mem_map") == 4
    assert next(c for c in fake.calls if c[0] == "set_access")[2] == 4 * C
    backend.close()


def test_device_pool_starts_zeroed() -> None:
    backend, fake, _ = start()
    for chunk in backend.device.chunks:
        assert fake.fds[chunk.fd].data == bytes(C)  # cuMemCreate's memory is not zeroed
    backend.close()


def test_host_pool_is_memfd_chunks_pinned_as_one_range() -> None:
    backend, fake, _ = start(host_chunks=3)
    host = backend.host
    assert (host.name, host.chunk_bytes, host.total) == ("host", C, 3 * C)
    for chunk in host.chunks:
        assert os.readlink(f"/proc/self/fd/{chunk.fd}").startswith("/memfd:tidalpool-host")
        assert os.fstat(chunk.fd).st_size == C
    assert list(fake.registered.values()) == [3 * C]
    backend.close()


def test_chunk_not_a_multiple_of_the_granularity_is_refused_with_the_nearest_sizes() -> None:
    with pytest.raises(CudaBackendError) as err:
        start(chunk=96 * KiB, device_chunks=2, host_chunks=2)
    assert str(err.value) == (
        "chunk size 96 KiB (98304 bytes) is not a multiple of the GPU's allocation granularity"
        " 64 KiB (65536 bytes); use 64 KiB (65536 bytes) or 128 KiB (131072 bytes)"
    )


def test_chunk_below_the_granularity_is_refused() -> None:
    with pytest.raises(CudaBackendError, match=r"use 64 KiB \(65536 bytes\)$"):
        check_chunk(16 * KiB, GRAN)
    check_chunk(3 * GRAN, GRAN)  # any whole number of granules


def test_refusal_releases_what_was_acquired() -> None:
    fake, nvml = FakeDriver(granularity=GRAN), FakeNvml()
    with pytest.raises(CudaBackendError):
        start(fake, nvml, chunk=96 * KiB, device_chunks=2, host_chunks=2)
    assert all_released(fake, nvml)


def test_pool_beyond_free_memory_is_refused_with_both_numbers() -> None:
    fake, nvml = FakeDriver(granularity=GRAN), FakeNvml(free=4 * C - 1, total=8 * C)
    with pytest.raises(CudaBackendError) as err:
        start(fake, nvml)
    assert str(err.value) == (
        "device pool of 512 KiB (524288 bytes) does not fit on GPU 0 (NVIDIA H100 80GB HBM3):"
        " 512 KiB (524287 bytes) free of 1 MiB (1048576 bytes)"
    )
    assert "mem_create" not in fake.names() and all_released(fake, nvml)


def test_pool_of_exactly_the_free_memory_starts() -> None:
    backend, _, _ = start(nvml=FakeNvml(free=4 * C))
    backend.close()


def test_pool_sizes_must_be_whole_chunks() -> None:
    fake = FakeDriver(granularity=GRAN)
    with pytest.raises(CudaBackendError, match=r"device pool of .* is not a whole number"):
        CudaBackend(C + 1, C, C, driver=fake, nvml=FakeNvml())
    with pytest.raises(ValueError, match="cuda mode must be one of auto, vmm, ipc"):
        CudaBackend(C, C, C, mode="fast", driver=fake, nvml=FakeNvml())
    assert fake.calls == []


# -- mode selection -----------------------------------------------------------------------------


def test_export_not_supported_falls_back_to_ipc_and_says_why() -> None:
    backend, fake, nvml = start(FakeDriver(granularity=GRAN, export_error=NOT_SUPPORTED))
    assert backend.mode == "ipc"
    assert backend.mode_reason == (
        "ipc fallback (no isolation between sessions): exporting a chunk as an fd failed:"
        " cuMemExportToShareableHandle failed: CUDA_ERROR_NOT_SUPPORTED (801)"
    )
    dev = backend.device
    assert [c.fd for c in dev.chunks] == [-1, -1, -1, -1]
    assert len(dev.ipc_handle) == 64
    assert not fake.handles  # the trial chunk was released
    assert [c[2] for c in fake.calls if c[0] == "mem_alloc"] == [4 * C]
    backend.close()
    assert all_released(fake, nvml)


def test_other_export_errors_are_not_hidden_by_the_fallback() -> None:
    fake, nvml = FakeDriver(granularity=GRAN, export_error=2), FakeNvml()
    with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        start(fake, nvml)
    assert all_released(fake, nvml)


def test_vmm_asked_for_fails_instead_of_falling_back() -> None:
    fake, nvml = FakeDriver(granularity=GRAN, export_error=NOT_SUPPORTED), FakeNvml()
    with pytest.raises(CudaBackendError, match=r"^vmm mode asked for, but exporting a chunk"):
        start(fake, nvml, mode="vmm")
    assert all_released(fake, nvml)


def test_no_vmm_support_falls_back_to_ipc() -> None:
    backend, fake, _ = start(FakeDriver(granularity=GRAN, vmm=False))
    assert backend.mode == "ipc"
    assert backend.mode_reason.endswith(
        "the GPU does not support virtual memory management with POSIX fd handles"
    )
    assert "mem_create" not in fake.names()
    backend.close()


def test_ipc_asked_for_skips_vmm() -> None:
    backend, fake, _ = start(mode="ipc")
    assert (backend.mode, backend.mode_reason) == (
        "ipc",
        "ipc mode asked for: no isolation between sessions",
    )
    assert "granularity" not in fake.names() and "mem_create" not in fake.names()
    backend.close()


def test_ipc_pool_starts_zeroed() -> None:
    backend, fake, _ = start(mode="ipc")
    (phys,) = fake.allocs.values()
    assert phys.data == bytes(4 * C)
    backend.close()


# -- scrub ------------------------------------------------------------------------------------


def test_scrub_zeroes_exactly_the_returned_device_chunk() -> None:
    backend, fake, _ = start()
    chunks = backend.device.chunks
    for c in chunks:
        fake.fds[c.fd].data[:] = bytes([c.index + 1]) * C  # a session wrote everywhere
    fake.calls.clear()
    backend.scrub(backend.device, chunks[2])
    assert fake.fds[chunks[2].fd].data == bytes(C)
    assert [fake.fds[c.fd].data[0] for c in chunks] == [1, 2, 0, 4]
    memset = [c for c in fake.calls if c[0] == "memset"]
    assert len(memset) == 1 and memset[0][2:4] == (0, C)
    assert fake.names()[-1] == "stream_synchronize"  # done before the chunk is handed out again
    backend.close()


def test_scrub_in_ipc_mode_zeroes_the_chunk_at_its_offset() -> None:
    backend, fake, _ = start(mode="ipc")
    (phys,) = fake.allocs.values()
    phys.data[:] = b"\x07" * (4 * C)
    backend.scrub(backend.device, backend.device.chunks[1])
    assert phys.data == b"\x07" * C + bytes(C) + b"\x07" * (2 * C)
    backend.close()


def test_scrub_zeroes_a_host_chunk_in_place() -> None:
    backend, _, _ = start(host_chunks=2)
    a, b = backend.host.chunks
    os.pwrite(a.fd, b"x" * C, 0)
    os.pwrite(b.fd, b"y" * C, 0)
    backend.scrub(backend.host, b)
    assert os.pread(b.fd, C, 0) == bytes(C)
    assert os.pread(a.fd, C, 0) == b"x" * C
    backend.close()


def test_scrub_refuses_a_chunk_of_another_pool() -> None:
    backend, _, _ = start(device_chunks=4, host_chunks=2)
    with pytest.raises(ValueError, match="chunk 3 is not a chunk of the host pool"):
        backend.scrub(backend.host, backend.device.chunks[3])
    backend.close()


# -- close ------------------------------------------------------------------------------------

_RELEASE = {
    "mem_release": "mem_create",
    "address_free": "address_reserve",
    "mem_unmap": "mem_map",
    "stream_destroy": "stream_create",
    "host_unregister": "host_register",
    "mem_free": "mem_alloc",
    "close_device": "open_device",
}


def _key(call: tuple[object, ...]) -> tuple[object, ...]:
    """What a call acquires or releases: (the acquiring call's name, handle or address)."""
    name = str(call[0])
    kind = _RELEASE.get(name, name)
    return (kind,) if kind == "open_device" else (kind, call[1])


@pytest.mark.parametrize("mode", ["vmm", "ipc"])
def test_close_releases_everything_in_reverse_order(mode: str) -> None:
    backend, fake, nvml = start(mode=mode)
    started = len(fake.calls)
    acquired = [_key(c) for c in fake.calls[:started] if c[0] in _RELEASE.values()]
    released_early = {_key(c) for c in fake.calls[:started] if c[0] in _RELEASE}
    held = [k for k in acquired if k not in released_early]  # not the probe's streams
    backend.close()
    released = [_key(c) for c in fake.calls[started:] if c[0] in _RELEASE]
    assert released == held[::-1]
    assert all_released(fake, nvml)
    for chunk in (*backend.device.chunks, *backend.host.chunks):
        if chunk.fd >= 0:
            with pytest.raises(OSError):
                os.fstat(chunk.fd)
    backend.close()  # idempotent
    assert len(fake.calls) == started + len(released)


def test_close_order_keys_match() -> None:
    assert _key(("mem_create", 7, C, True)) == _key(("mem_release", 7)) == ("mem_create", 7)
    assert _key(("mem_map", 1 << 40, C, 7)) == _key(("mem_unmap", 1 << 40, C))


# -- facts and the bandwidth probe ----------------------------------------------------------------


def test_facts() -> None:
    backend, _, nvml = start()
    nvml.free = 60 << 30  # live
    assert backend.facts() == {
        "device": "NVIDIA H100 80GB HBM3",
        "gpu": 0,
        "pci_bus_id": "0000:3B:00.0",
        "mode": "vmm",
        "total_bytes": 80 << 30,
        "free_bytes": 60 << 30,
        "chunk_bytes": C,
        "granularity_bytes": GRAN,
        "pcie_generation": 5,
        "pcie_width": 16,
        "h2d_gbps": 25.0,
        "d2h_gbps": 20.0,
    }
    nvml.fail_memory = True
    assert backend.facts()["free_bytes"] == 79 << 30  # the start's numbers when NVML fails
    backend.close()


def test_probe_copies_pinned_host_memory_on_non_default_streams() -> None:
    backend, fake, _ = start(device_chunks=4, host_chunks=2, probe_bytes=C, probe_total=8 * C)
    timed = fake.copies
    # one warm-up copy each way, then 8 timed copies of one chunk each way
    assert [(d, n) for d, n, _ in timed] == [("h2d", C), ("d2h", C)] + [("h2d", C)] * 8 + [
        ("d2h", C)
    ] * 8
    assert all(pinned for _, _, pinned in timed)
    copy_streams = {c[4] for c in fake.calls if c[0] in ("htod", "dtoh")}
    assert len(copy_streams) == 2 and 0 not in copy_streams
    assert backend.bandwidth == Bandwidth(
        pytest.approx(25.0, rel=1e-12), pytest.approx(20.0, rel=1e-12), 8 * C
    )
    # the probed host bytes are zero again
    assert os.pread(backend.host.chunks[0].fd, C, 0) == bytes(C)
    backend.close()


def test_probe_span_is_bounded_by_the_smaller_pool() -> None:
    backend, fake, _ = start(device_chunks=4, host_chunks=1, probe_bytes=1 << 30, probe_total=C)
    assert {n for _, n, _ in fake.copies} == {C}
    assert backend.bandwidth.bytes_each_way == C
    backend.close()


def test_probe_can_be_skipped() -> None:
    backend, fake, _ = start(probe_bytes=0)
    assert fake.copies == []
    facts = backend.facts()
    assert (facts["h2d_gbps"], facts["d2h_gbps"]) == (0.0, 0.0)
    backend.close()


def test_probe_arithmetic() -> None:
    fake = FakeDriver(granularity=GRAN, h2d_gbps=12.5, d2h_gbps=6.25)
    fake.open_device(0)
    dev = fake.mem_alloc(C)
    host = bytearray(C)
    buf = (ctypes.c_char * C).from_buffer(host)
    result = probe_bandwidth(fake, DevicePtr(dev), ctypes.addressof(buf), C, 3)
    assert result.bytes_each_way == 3 * C
    assert result.h2d_gbps == pytest.approx(12.5, rel=1e-12)
    assert result.d2h_gbps == pytest.approx(6.25, rel=1e-12)
    # the timed events are on the probe's own streams; all probe resources are gone
    assert not fake.events and set(fake.streams) == {0}
    del buf


def test_gbps() -> None:
    assert gbps(10**9, 1000.0) == 1.0
    assert gbps(25 * 10**9, 1000.0) == 25.0
    assert gbps(1 << 30, 40.0) == pytest.approx(26.843545600)
    with pytest.raises(ValueError, match=r"a copy of 5 bytes took 0\.0 ms"):
        gbps(5, 0.0)


# -- file descriptors -------------------------------------------------------------------------


def test_fd_limit_is_raised_up_to_the_hard_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = [(1024, 4096)]
    monkeypatch.setattr(cuda_backend.resource, "getrlimit", lambda _: limits[-1])
    monkeypatch.setattr(cuda_backend.resource, "setrlimit", lambda _, v: limits.append(v))
    ensure_fd_limit(1000)
    assert limits == [(1024, 4096)]
    ensure_fd_limit(3000)
    assert limits[-1] == (3000, 4096)
    with pytest.raises(CudaBackendError) as err:
        ensure_fd_limit(5000)
    assert str(err.value) == (
        "the pools need 5000 file descriptors (one a chunk) but the hard limit is 4096:"
        " use a larger chunk size or raise LimitNOFILE"
    )


# -- the GPU's PCI bus id travels in the lease ----------------------------------------------------


def test_the_lease_names_the_daemons_gpu_by_pci_bus_id(tmp_path: Path) -> None:
    fake = FakeDriver(granularity=GRAN, buses={"0000:3b:00.0": 0, "0000:86:00.0": 1})
    backend, _, nvml = start(driver=fake, gpu=1, device_chunks=2, host_chunks=2)
    assert backend.pci_bus_id == "0000:86:00.0" == nvml.opened
    assert backend.facts()["pci_bus_id"] == "0000:86:00.0"
    settings = Settings(
        backend="cuda",
        device_pool=Bytes(2 * C),
        host_pool=Bytes(2 * C),
        default_device_lease=Bytes(C),
        default_host_lease=Bytes(C),
        lease_alignment=Bytes(C),
        chunk_size=Bytes(C),
        socket_dir=tmp_path,
        plan_cache_dir=tmp_path,
    )
    registry = Registry(settings, backend)
    session = registry.open(0, 0, "job", 1, os.getuid())
    lease = lease_message(session, backend)
    assert (lease.backend, lease.mode, lease.pci_bus_id) == ("cuda", "vmm", "0000:86:00.0")
    sim = SimBackend(C, C, C)
    try:
        assert lease_message(session, sim).pci_bus_id == ""
    finally:
        sim.close()
    registry.end(session.id, pool_pb2.Goodbye.REASON_DETACHED, "done")
    backend.close()


def test_the_fake_finds_a_gpu_by_bus_id_as_cuda_does() -> None:
    fake = FakeDriver(buses={"0000:3B:00.0": 1, "0000:86:00.0": 0})
    assert fake.device_by_pci_bus_id("0000:86:00.0") == 0
    assert fake.device_by_pci_bus_id("3b:00.0") == 1
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_DEVICE"):
        fake.device_by_pci_bus_id("0000:AF:00.0")  # not visible in this process
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        fake.device_by_pci_bus_id("GPU-0")
    fake.open_device(1)
    assert fake.pci_bus_id() == "0000:3B:00.0"
