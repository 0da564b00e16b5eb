"""Page-mapped device memory on a real GPU: CudaPageSpace maps a lease's exportable VMM chunks, a
whole chunk a page (cuMemMap maps a handle only from its first byte), and the bytes follow the
physical pages when they are unmapped and mapped again at another address."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
from tidalclient.devices.pages import CudaPageSpace
from tidalcore.cuda_driver import CudaDriver, DevicePtr, MemHandle, StreamHandle

FRAMES = 8


class Gpu:
    """The driver on device 0, eight exportable chunks of one granule, and a mapping of each
    whole chunk in a range of its own, to read where a page's bytes really are."""

    def __init__(self) -> None:
        self.driver = CudaDriver()
        self.driver.open_device(0)
        self.page = self.driver.granularity(exportable=True)
        self.handles: list[MemHandle] = [
            self.driver.mem_create(self.page, exportable=True) for _ in range(FRAMES)
        ]
        self.whole = self.driver.address_reserve(FRAMES * self.page, self.page)
        for k, handle in enumerate(self.handles):
            self.driver.mem_map(DevicePtr(self.whole + k * self.page), self.page, handle)
        self.driver.set_access(self.whole, FRAMES * self.page)

    def read(self, ptr: int, n: int) -> bytes:
        out = ctypes.create_string_buffer(n)
        self.driver.memcpy_dtoh(ctypes.addressof(out), DevicePtr(ptr), n)
        return out.raw

    def write(self, ptr: int, data: bytes) -> None:
        src = ctypes.create_string_buffer(data, len(data))
        self.driver.memcpy_htod(DevicePtr(ptr), ctypes.addressof(src), len(data))
        self.driver.stream_synchronize(StreamHandle(0))  # a pageable copy may still be in flight

    def frame_address(self, p: int) -> int:
        """Where physical page p (chunk p) is in the whole-chunk mapping."""
        return self.whole + p * self.page

    def close(self) -> None:
        d = self.driver
        for k in range(FRAMES):  # one cuMemUnmap per cuMemMap
            d.mem_unmap(DevicePtr(self.whole + k * self.page), self.page)
        d.address_free(self.whole, FRAMES * self.page)
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


def test_the_driver_maps_a_handle_only_from_its_first_byte(gpu: Gpu) -> None:
    """Why a page on cuda is a whole chunk: cuMemMap at an offset into a handle is refused
    (CUDA_ERROR_NOT_SUPPORTED from the driver of the H200 of 2026-11-28). Should a driver map
    at offsets, this fails, and pages smaller than a chunk could come back."""
    cu = pytest.importorskip("cuda.bindings.driver")
    d = gpu.driver
    two = d.mem_create(2 * gpu.page, exportable=True)
    at = d.address_reserve(gpu.page, gpu.page)
    try:
        (result,) = cu.cuMemMap(
            int(at), gpu.page, gpu.page, cu.CUmemGenericAllocationHandle(two), 0
        )
        if result == cu.CUresult.CUDA_SUCCESS:
            d.mem_unmap(at, gpu.page)
        assert result in (
            cu.CUresult.CUDA_ERROR_NOT_SUPPORTED,
            cu.CUresult.CUDA_ERROR_INVALID_VALUE,
        )
    finally:
        d.address_free(at, gpu.page)
        d.mem_release(two)


def test_pages_land_by_the_formula_and_follow_their_frames(gpu: Gpu) -> None:
    page = gpu.page
    space = CudaPageSpace(gpu.driver, gpu.handles, page, page, 16 * page)
    assert space.address % page == 0 and space.frames == FRAMES
    order = [2, 3, 4, 0, 7]
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
    space = CudaPageSpace(gpu.driver, gpu.handles, page, page, 4 * page)
    space.map(0, [5, 6])  # two cuMemMaps: chunks 5 and 6
    gpu.write(gpu.frame_address(6) + 3, b"through the chunk")
    assert gpu.read(space.address + page + 3, 17) == b"through the chunk"
    gpu.write(space.address + 5, b"through the page")
    assert gpu.read(gpu.frame_address(5) + 5, 16) == b"through the page"
    space.close()  # retires: unmaps the pages the space still has mapped
    assert space.mapped_pages == 0
