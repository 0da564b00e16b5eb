"""Swap streams and events on a real GPU: pinned memfd host memory, copies out and back in
ordered by events, host functions in stream order, the compute stream waiting on a swap-in."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
from tidalclient.devices.cuda import CudaStream, swap_streams
from tidalclient.devices.streams import StreamError
from tidalcore.chunks import PinnedChunkMapping
from tidalcore.cuda_driver import CudaDriver, DevicePtr

MiB = 1 << 20
SIZE = 32 * MiB


@pytest.fixture
def gpu() -> Iterator[tuple[CudaDriver, PinnedChunkMapping, DevicePtr]]:
    driver = CudaDriver()
    driver.open_device(0)
    fds = []
    for _ in range(2):
        fd = os.memfd_create("tidalpool-test-host", os.MFD_CLOEXEC)
        os.ftruncate(fd, SIZE)
        fds.append(fd)
    host = PinnedChunkMapping(driver, fds, SIZE)
    for fd in fds:
        os.close(fd)
    device = driver.mem_alloc(2 * SIZE)
    yield driver, host, device
    driver.mem_free(device)
    host.close()
    driver.close_device()


def test_out_and_back_in_is_bit_exact(
    gpu: tuple[CudaDriver, PinnedChunkMapping, DevicePtr],
) -> None:
    driver, host, device = gpu
    assert host.registered
    data = random.Random(7).randbytes(SIZE)
    host.buffer(0, SIZE)[:] = data
    out, into = swap_streams(driver)
    into.copy(device, host.address, SIZE)  # host chunk 0 → device
    arrived = into.record()
    out.wait_event(arrived)  # the copy out must read what the copy in wrote
    out.copy(host.address + SIZE, device, SIZE)  # device → host chunk 1
    left = out.record()
    assert left.wait()
    assert arrived.query() and left.query()
    assert bytes(host.buffer(SIZE, SIZE)) == data
    assert (into.bytes_copied, out.bytes_copied) == (SIZE, SIZE)
    out.close()
    into.close()


def test_host_functions_run_in_stream_order(
    gpu: tuple[CudaDriver, PinnedChunkMapping, DevicePtr],
) -> None:
    driver, host, device = gpu
    s = CudaStream(driver, "s", "h2d")
    seen: list[str] = []
    s.launch(lambda: seen.append("before"))
    s.copy(device, host.address, SIZE)
    s.launch(lambda: seen.append("after"))
    s.launch(lambda: 1 // 0)
    failed = s.record()
    s.launch(lambda: seen.append("last"))
    fine = s.record()
    with pytest.raises(StreamError, match="ZeroDivisionError"):
        failed.wait()
    assert fine.wait()
    assert seen == ["before", "after", "last"]
    s.close()


def test_the_compute_stream_waits_for_a_swap_in(
    gpu: tuple[CudaDriver, PinnedChunkMapping, DevicePtr],
) -> None:
    driver, host, device = gpu
    host.buffer(0, SIZE)[:] = b"\x5a" * SIZE
    compute = CudaStream.wrap(driver, 0)
    into = CudaStream(driver, "swap-in", "h2d")
    into.copy(device, host.address, SIZE)
    compute.wait_event(into.record())
    # work on the compute stream after the wait sees the swapped-in bytes
    compute.copy_to_host(host.address + SIZE, device, SIZE)
    compute.synchronize()
    assert bytes(host.buffer(SIZE, 16)) == b"\x5a" * 16
    compute.close()
    into.close()


def test_event_wait_with_a_timeout(gpu: tuple[CudaDriver, PinnedChunkMapping, DevicePtr]) -> None:
    driver, host, device = gpu
    s = CudaStream(driver, "s", "d2h")
    for _ in range(8):
        s.copy(host.address, device, SIZE)
    event = s.record()
    assert event.wait(timeout=30.0)
    s.close()
