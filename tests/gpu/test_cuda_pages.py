"""Page-mapped device memory on a real GPU: CudaPageSpace maps pages of exportable VMM chunks (as
a lease's) at offsets, and the bytes follow the physical pages when they are unmapped and mapped
again at another address."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
from tidalclient.devices.pages import CudaPageSpace
from tidalcore.cuda_driver import CudaDriver, DevicePtr, MemHandle, StreamHandle

PER_CHUNK = 4
CHUNKS = 2


class Gpu:
    """The driver on device 0, two exportable chunks, and a mapping of each whole chunk (offset 0)
    in a range of its own, to read where a page's bytes really are."""

    def __init__(self) -> None:
        self.driver = CudaDriver()
        self.driver.open_device(0)
        self.page = self.driver.granularity(exportable=True)
        self.chunk = PER_CHUNK * self.page
        self.handles: list[MemHandle] = [
            self.driver.mem_create(self.chunk, exportable=True) for _ in range(CHUNKS)
        ]
        self.whole = self.driver.address_reserve(CHUNKS * self.chunk, self.page)
        for k, handle in enumerate(self.handles):
            self.driver.mem_map(DevicePtr(self.whole + k * self.chunk), self.chunk, handle)
        self.driver.set_access(self.whole, CHUNKS * self.chunk)

    def read(self, ptr: int, n: int) -> bytes:
        out = ctypes.create_string_buffer(n)
        self.driver.memcpy_dtoh(ctypes.addressof(out), DevicePtr(ptr), n)
        return out.raw

    def write(self, ptr: int, data: bytes) -> None:
        src = ctypes.create_string_buffer(data, len(data))
        self.driver.memcpy_htod(DevicePtr(ptr), ctypes.addressof(src), len(data))
        self.driver.stream_synchronize(StreamHandle(0))  # a pageable copy may still be in flight

    def frame_address(self, p: int) -> int:
        """Where physical page p is in the whole-chunk mapping: chunk p // 4, page p % 4."""
        return self.whole + (p // PER_CHUNK) * self.chunk + (p % PER_CHUNK) * self.page

    def close(self) -> None:
        d = self.driver
        for k in range(CHUNKS):  # one cuMemUnmap per cuMemMap
            d.mem_unmap(DevicePtr(self.whole + k * self.chunk), self.chunk)
        d.address_free(self.whole, CHUNKS * self.chunk)
        for handle in self.handles:
            d.mem_release(handle)
        d.close_device()


@pytest.fixture
def gpu() -> Iterator[Gpu]:
    g = Gpu()
    yield g
    g.close()


def stamp(p: int, page: int) -> bytes:
    """A page's worth of bytes that says which frame it was written to."""
    return bytes([0x10 + p]) * (page // 2) + bytes(range(256)) * (page // 2 // 256)


def test_pages_land_by_the_formula_and_follow_their_frames(gpu: Gpu) -> None:
    page = gpu.page
    space = CudaPageSpace(gpu.driver, gpu.handles, gpu.chunk, page, 16 * page)
    assert space.address % page == 0 and space.frames == CHUNKS * PER_CHUNK
    order = [2, 3, 4, 0, 7]  # runs: 2-3 of chunk 0, 4 of chunk 1, 0 of chunk 0, 7 of chunk 1
    space.map(page, order)
    assert space.mapped_pages == 5
    for k, p in enumerate(order):
        gpu.write(space.address + (1 + k) * page, stamp(p, page))
    for p in order:  # each page is where the formula says, seen through the whole chunk
        assert gpu.read(gpu.frame_address(p), page) == stamp(p, page)
    space.unmap(page, 5)
    assert space.mapped_pages == 0
    space.map(9 * page, order[::-1])  # the same frames, elsewhere and in another order
    for k, p in enumerate(order[::-1]):
        assert gpu.read(space.address + (9 + k) * page, page) == stamp(p, page)
    space.unmap(9 * page, 5)
    space.retire()
    space.close()


def test_a_mapped_page_is_the_chunk_memory_both_ways(gpu: Gpu) -> None:
    page = gpu.page
    space = CudaPageSpace(gpu.driver, gpu.handles, gpu.chunk, page, 4 * page)
    space.map(0, [5, 6])  # one cuMemMap: pages 1-2 of chunk 1
    gpu.write(gpu.frame_address(6) + 3, b"through the chunk")
    assert gpu.read(space.address + page + 3, 17) == b"through the chunk"
    gpu.write(space.address + 5, b"through the page")
    assert gpu.read(gpu.frame_address(5) + 5, 16) == b"through the page"
    space.close()  # retires: unmaps the pages the space still has mapped
    assert space.mapped_pages == 0
