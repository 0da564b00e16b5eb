"""tidalpool.cupy on a real GPU: CuPy device arrays in a lease, pinned arrays in the host lease,
blocks freed once CuPy drops them, and ops on CuPy arrays recorded by block."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from tidalclient.executors.base import Block
from tidalclient.executors.python import PythonExecutor
from tidalcore.chunks import PinnedChunkMapping
from tidalcore.cuda_driver import CudaDriver

MiB = 1 << 20


class Lease:
    def __init__(self, address: int, length: int) -> None:
        self.address, self.length = address, length


class GpuSession:
    """The parts of a Session that tidalpool.cupy uses, over real device and pinned memory."""

    def __init__(self, driver: CudaDriver, device_bytes: int, host: PinnedChunkMapping) -> None:
        self.executor = PythonExecutor(device_bytes)
        self.device = Lease(int(driver.mem_alloc(device_bytes)), device_bytes)
        self.host = host
        self.cuda = None  # tidalpool.cupy.use() is given the device
        self.residency = None  # not paged: no block to pin
        self.ops: list[tuple[list[int], list[int], str]] = []

    def malloc(self, nbytes: int) -> Block:
        return self.executor.malloc(nbytes)

    def free(self, block: Block) -> None:
        self.executor.free(block)

    def address(self, block: Block) -> int:
        return self.device.address + block.offset

    @contextmanager
    def op(self, reads: list[Block], writes: list[Block], name: str) -> Iterator[None]:
        self.ops.append(([b.id for b in reads], [b.id for b in writes], name))
        yield


@pytest.fixture
def session() -> Iterator[tuple[Any, GpuSession]]:
    cupy = pytest.importorskip("cupy")
    import tidalclient.cupy as tpc

    driver = CudaDriver()
    driver.open_device(0)
    fd = os.memfd_create("tidalpool-test-host", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4 * MiB)
    host = PinnedChunkMapping(driver, [fd], 4 * MiB)
    os.close(fd)
    s = GpuSession(driver, 64 * MiB, host)
    yield cupy, s
    tpc.stop()
    gc.collect()
    cupy.cuda.Device(0).synchronize()
    driver.mem_free(s.device.address)  # type: ignore[arg-type]
    host.close()
    driver.close_device()


def test_device_arrays_live_in_the_lease(session: tuple[Any, GpuSession]) -> None:
    import tidalclient.cupy as tpc

    cupy, s = session
    tpc.use(s, device=0)  # type: ignore[arg-type]
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    y = x * 2
    lo, hi = s.device.address, s.device.address + s.device.length
    assert lo <= x.data.ptr < hi and lo <= y.data.ptr < hi
    assert float(y[-1]) == 2.0 * ((1 << 20) - 1)
    assert float(y.sum()) == pytest.approx(float((1 << 20) * ((1 << 20) - 1)))
    live = s.executor.live_blocks
    del y
    gc.collect()
    z = cupy.empty(16, dtype=cupy.uint8)  # the next allocation frees what CuPy dropped
    assert s.executor.live_blocks < live + 1
    del z


def test_pinned_arrays_live_in_the_host_lease(session: tuple[Any, GpuSession]) -> None:
    import cupyx
    import tidalclient.cupy as tpc

    cupy, s = session
    tpc.use(s, device=0)  # type: ignore[arg-type]
    a = cupyx.empty_pinned((1024,), dtype="float32")
    assert s.host.address <= a.ctypes.data < s.host.address + s.host.length
    a[:] = 3.0
    d = cupy.asarray(a)
    assert float(d.sum()) == 3.0 * 1024


def test_ops_record_cupy_arrays_by_block(session: tuple[Any, GpuSession]) -> None:
    import tidalclient.cupy as tpc

    cupy, s = session
    allocator = tpc.use(s, pinned=False, device=0)  # type: ignore[arg-type]
    x = cupy.ones(256, dtype=cupy.float32)
    y = cupy.empty_like(x)
    with tpc.op(s, [x], [y], name="scale") as (xv, yv):  # type: ignore[arg-type]
        cupy.multiply(xv, 4, out=yv)
    assert s.ops == [([allocator.block_of(x).id], [allocator.block_of(y).id], "scale")]
    assert float(y.sum()) == 1024.0
