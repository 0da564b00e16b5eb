"""The page layer of virtual residency: free frames, and pages of a lease mapped under a reserved
range on sim (memfd chunks) and on cuda (the fake driver's VMM handles)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from tidalclient.devices import pages
from tidalclient.devices.pages import CudaPageSpace, Frames, PageSpace, SimPageSpace
from tidalcore.cuda_driver import CudaError, DevicePtr, MemHandle

from tests.unit.fake_cuda import FakeDriver

PAGE = 2 * mmap.PAGESIZE  # larger than the OS page, so the range's alignment is checked
PER_CHUNK = 4
CHUNK = PER_CHUNK * PAGE
CHUNKS = 3
FRAMES = CHUNKS * PER_CHUNK
LENGTH = 16 * PAGE


def page_bytes(p: int) -> bytes:
    """What physical page `p` holds before a test writes: its number, then a fill."""
    return p.to_bytes(2, "little") + bytes([0x40 + p]) * (PAGE - 2)


# -- Frames -----------------------------------------------------------------------------------


def test_frames_take_the_lowest_run_long_enough_else_the_longest_runs() -> None:
    f = Frames(8)
    assert (f.count, f.free) == (8, 8)
    assert f.take(3) == [0, 1, 2]
    assert f.take(0) == []
    assert f.free == 5
    f.give([1])
    assert f.take(1) == [1]  # the lowest free page
    f.give([0, 2])  # free: 0, 2, 3-7
    assert f.free == 7
    assert f.take(2) == [2, 3]  # the lowest run of two, though 0 is free
    assert f.take(5) == [4, 5, 6, 7, 0]  # no run of five: the longest first
    assert f.free == 0


def test_frames_take_these_whole_or_nothing_in_runs_and_scattered() -> None:
    f = Frames(8)
    assert f.take(8) == list(range(8))
    f.give([5, 3, 4], parked=True)  # one run, out of order
    f.give([0, 7])
    assert f.free == 5
    assert not f.take_these([2, 3, 4])  # 2 is taken: a run with one taken page
    assert not f.take_these([4, 3, 4])  # the same page twice
    assert not f.take_these([7, 8])  # not a page of the lease
    assert f.free == 5  # none of those took anything
    assert f.take_these([4, 5, 3])
    assert f.take_these([7, 0])
    assert f.free == 0
    f.give([1, 2, 3])
    with pytest.raises(ValueError, match=r"^page 3 is already free$"):
        f.give([3, 4, 5])  # a run in which one page is free: refused, nothing changed
    assert f.free == 3
    f.give([4, 5, 6], parked=True)
    assert f.take(3, parked=False) == [1, 2, 3]  # parked pages are handed out last
    assert f.take(3, parked=False) is None
    assert f.take(3) == [4, 5, 6]


def test_frames_too_few_is_none_and_takes_nothing() -> None:
    f = Frames(4)
    assert f.take(3) == [0, 1, 2]
    assert f.take(2) is None
    assert f.free == 1
    assert f.take(1) == [3]
    assert f.take(1) is None
    assert Frames(0).take(1) is None


def test_frames_refuse_double_gives_and_strangers_before_changing_anything() -> None:
    f = Frames(4)
    assert f.take(2) == [0, 1]
    with pytest.raises(ValueError, match=r"^page 2 is already free$"):
        f.give([2])
    with pytest.raises(ValueError, match=r"^page 1 is already free$"):
        f.give([1, 1])
    with pytest.raises(ValueError, match=r"^page 4 is not a page of this lease \(0..3\)$"):
        f.give([0, 4])
    with pytest.raises(ValueError, match=r"^page -1 is not a page of this lease"):
        f.give([-1])
    assert f.free == 2  # none of the refused gives changed anything
    f.give([1, 0])
    assert f.free == 4
    with pytest.raises(ValueError, match=r"^page 0 is already free$"):
        f.give([0])
    with pytest.raises(ValueError, match="cannot take -1 pages"):
        f.take(-1)


# -- sim ----------------------------------------------------------------------------------------


@pytest.fixture
def chunk_fds() -> Iterator[list[int]]:
    """Three memfd chunks; physical page p holds `page_bytes(p)`."""
    fds = []
    for k in range(CHUNKS):
        fd = os.memfd_create(f"test-pages-{k}", os.MFD_CLOEXEC)
        os.ftruncate(fd, CHUNK)
        for i in range(PER_CHUNK):
            os.pwrite(fd, page_bytes(k * PER_CHUNK + i), i * PAGE)
        fds.append(fd)
    yield fds
    for fd in fds:
        os.close(fd)


@pytest.fixture
def sim(chunk_fds: list[int]) -> Iterator[SimPageSpace]:
    space = SimPageSpace(chunk_fds, CHUNK, PAGE, LENGTH)
    yield space
    space.close()


def read(space: PageSpace, offset: int, n: int) -> bytes:
    return ctypes.string_at(space.address + offset, n)


def write(space: PageSpace, offset: int, data: bytes) -> None:
    ctypes.memmove(space.address + offset, data, len(data))


def test_sim_geometry(sim: SimPageSpace) -> None:
    assert sim.address % PAGE == 0
    assert (sim.length, sim.page, sim.frames, sim.mapped_pages) == (LENGTH, PAGE, FRAMES, 0)


def test_sim_frames_land_where_the_formula_says(sim: SimPageSpace, chunk_fds: list[int]) -> None:
    sim.map(PAGE, [2, 3, 4, 11, 0])
    assert sim.mapped_pages == 5
    for k, p in enumerate([2, 3, 4, 11, 0]):
        assert read(sim, (1 + k) * PAGE, PAGE) == page_bytes(p)
    # a write through the page space is in chunk p // 4 at byte (p % 4) * PAGE
    write(sim, 4 * PAGE + 100, b"eleven")  # virtual page 4 shows frame 11: chunk 2, page 3
    assert os.pread(chunk_fds[2], 6, 3 * PAGE + 100) == b"eleven"
    # a write into the chunk shows through the page space
    os.pwrite(chunk_fds[1], b"four", 0)  # frame 4 is at virtual page 3
    assert read(sim, 3 * PAGE, 4) == b"four"


def test_sim_round_trip_through_another_address(sim: SimPageSpace) -> None:
    data = bytes(range(256)) * (3 * PAGE // 256)
    sim.map(0, [7, 8, 9])
    write(sim, 0, data)
    sim.unmap(0, 3)
    assert sim.mapped_pages == 0
    sim.map(10 * PAGE, [7, 8, 9])
    assert read(sim, 10 * PAGE, 3 * PAGE) == data
    sim.unmap(10 * PAGE, 3)
    sim.map(5 * PAGE, [9, 8, 7])  # reversed: each page lands on its own frame
    assert read(sim, 5 * PAGE, PAGE) == data[2 * PAGE :]
    assert read(sim, 7 * PAGE, PAGE) == data[:PAGE]


def test_sim_keeps_its_own_fds(chunk_fds: list[int]) -> None:
    duplicates = [os.dup(fd) for fd in chunk_fds]
    space = SimPageSpace(duplicates, CHUNK, PAGE, LENGTH)
    for fd in duplicates:
        os.close(fd)
    space.map(0, [5])
    assert read(space, 0, PAGE) == page_bytes(5)
    space.close()


def test_sim_unmapped_pages_are_whole_map_calls(sim: SimPageSpace) -> None:
    sim.map(0, [0, 1])
    sim.map(2 * PAGE, [6])
    sim.map(3 * PAGE, [2, 3])
    with pytest.raises(ValueError, match=r"^page 1 is inside the map call of page 0: unmap it"):
        sim.unmap(PAGE, 1)
    with pytest.raises(ValueError, match=r"^pages \[2, 4\) would split the map call \[3, 5\)$"):
        sim.unmap(2 * PAGE, 2)
    with pytest.raises(ValueError, match=rf"^page 5 \(offset {5 * PAGE}\) is not mapped$"):
        sim.unmap(3 * PAGE, 3)
    assert sim.mapped_pages == 5  # nothing was unmapped by the refused calls
    sim.unmap(0, 5)  # three calls at once
    assert sim.mapped_pages == 0
    sim.map(0, [0, 1, 2, 3, 6])  # every frame is free again


def test_sim_argument_errors_change_nothing(sim: SimPageSpace) -> None:
    sim.map(2 * PAGE, [3])
    cases: list[tuple[int, list[int], str]] = [
        (1, [0], rf"^offset 1 is not a multiple of the page \({PAGE} bytes\)$"),
        (PAGE, [0, 1], rf"^page 2 \(offset {2 * PAGE}\) is already mapped$"),
        (0, [FRAMES], rf"^frame {FRAMES} is outside the lease of {FRAMES} pages$"),
        (0, [-1], rf"^frame -1 is outside the lease of {FRAMES} pages$"),
        (0, [4, 4], r"^frame 4 appears twice$"),
        (0, [], r"^0 pages at offset 0: nothing to do$"),
        (LENGTH - PAGE, [0, 1], rf"^bytes \[{LENGTH - PAGE}, {LENGTH + PAGE}\) are outside"),
        (-PAGE, [0], rf"^bytes \[{-PAGE}, 0\) are outside the range of {LENGTH}$"),
    ]
    for offset, frames, message in cases:
        with pytest.raises(ValueError, match=message):
            sim.map(offset, frames)
    with pytest.raises(ValueError, match=r"^page 0 \(offset 0\) is not mapped$"):
        sim.unmap(0, 1)
    with pytest.raises(ValueError, match=r"^offset 7 is not a multiple"):
        sim.unmap(7, 1)
    with pytest.raises(ValueError, match=r"^0 pages at offset 0: nothing to do$"):
        sim.unmap(0, 0)
    assert sim.mapped_pages == 1
    assert read(sim, 2 * PAGE, PAGE) == page_bytes(3)


def test_sim_one_frame_may_show_at_two_addresses(sim: SimPageSpace) -> None:
    sim.map(0, [3])
    sim.map(5 * PAGE, [3])  # a stale mapping and its frame's next holder: the same bytes
    ctypes.memmove(sim.address, b"both", 4)
    assert read(sim, 5 * PAGE, 4) == b"both"
    sim.unmap(0, 1)
    assert read(sim, 5 * PAGE, 4) == b"both" and sim.mapped_pages == 1


def test_sim_says_when_the_system_runs_out_of_mappings(
    sim: SimPageSpace, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim.map(0, [0])
    calls = []

    def out_of_maps(at: int, size: int, fd: int, offset: int, what: str) -> None:
        calls.append(at)
        if len(calls) == 2:  # the second run of the call: the first must be undone
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        real_map_shared(at, size, fd, offset, what)

    real_map_shared = pages.map_shared
    monkeypatch.setattr(pages, "map_shared", out_of_maps)
    with pytest.raises(OSError, match=r"vm\.max_map_count .*use larger pages"):
        sim.map(2 * PAGE, [3, 1])  # two runs: frame 3, then frame 1
    assert sim.mapped_pages == 1  # nothing of the failed call stays
    assert len(calls) == 2


def test_sim_geometry_errors(chunk_fds: list[int]) -> None:
    os_page = mmap.PAGESIZE
    with pytest.raises(ValueError, match=rf"^page of {os_page // 2} bytes is not a multiple of"):
        SimPageSpace(chunk_fds, CHUNK, os_page // 2, LENGTH)
    with pytest.raises(ValueError, match=rf"^page of {3 * PAGE} bytes does not divide the chunk"):
        SimPageSpace(chunk_fds, CHUNK, 3 * PAGE, LENGTH)
    with pytest.raises(ValueError, match=rf"^range of {PAGE + 1} bytes is not a positive number"):
        SimPageSpace(chunk_fds, CHUNK, PAGE, PAGE + 1)
    with pytest.raises(ValueError, match=r"^a lease of 0 chunks of"):
        SimPageSpace([], CHUNK, PAGE, LENGTH)
    with pytest.raises(ValueError, match=rf"^chunk 0 holds {CHUNK} bytes, fewer than {2 * CHUNK}$"):
        SimPageSpace(chunk_fds, 2 * CHUNK, PAGE, LENGTH)


def mapped_at(address: int) -> bool:
    """Whether any mapping of this process covers `address` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_sim_retire_reaches_no_chunk_and_close_frees_the_range(
    sim: SimPageSpace, chunk_fds: list[int]
) -> None:
    sim.map(0, [1])
    sim.retire()
    assert sim.mapped_pages == 0
    assert read(sim, 0, 8) == bytes(8)  # private zero pages, as ChunkMapping.retire
    write(sim, 0, b"stale")
    assert os.pread(chunk_fds[0], PAGE, PAGE) == page_bytes(1)  # the chunk is untouched
    with pytest.raises(RuntimeError, match="retired"):
        sim.map(0, [2])
    with pytest.raises(RuntimeError, match="retired"):
        sim.unmap(0, 1)
    sim.retire()  # idempotent
    address = sim.address
    assert mapped_at(address) and mapped_at(address + LENGTH - 1)
    sim.close()
    assert not mapped_at(address) and not mapped_at(address + LENGTH - 1)
    sim.close()  # idempotent


# An unmapped page faults: the child maps, writes and reads a page, unmaps it (or never maps
# one), says how far it got, then reads the page; it must die of SIGSEGV there.
FAULT_CHILD = textwrap.dedent(
    """
    import ctypes, os, sys
    from tidalclient.devices.pages import SimPageSpace

    page, unmap = int(sys.argv[1]), sys.argv[2] == "unmap"
    fd = os.memfd_create("fault", 0)
    os.ftruncate(fd, page)
    space = SimPageSpace([fd], page, page, 4 * page)
    space.map(page, [0])
    ctypes.memmove(space.address + page, b"old bytes", 9)
    assert ctypes.string_at(space.address + page, 9) == b"old bytes"
    if unmap:
        space.unmap(page, 1)
    at = space.address + (page if unmap else 2 * page)
    print("reading", flush=True)
    print("read", ctypes.string_at(at, 9), flush=True)
    """
)


@pytest.mark.parametrize("how", ["unmap", "never-mapped"])
def test_sim_unmapped_page_faults(how: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    child = subprocess.run(
        [sys.executable, "-c", FAULT_CHILD, str(PAGE), how],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert child.stdout == "reading\n", child.stderr
    assert child.returncode == -signal.SIGSEGV, child.stderr


# -- cuda (fake driver) -----------------------------------------------------------------------
# On cuda a page is a whole chunk: cuMemMap maps a handle only from its first byte.


@pytest.fixture
def fake() -> Iterator[FakeDriver]:
    driver = FakeDriver(granularity=PAGE)
    driver.open_device(0)
    yield driver


@pytest.fixture
def handles(fake: FakeDriver) -> list[MemHandle]:
    """One chunk a page, FRAMES of them; physical page p holds `page_bytes(p)`."""
    out = []
    for p in range(FRAMES):
        h = fake.mem_create(PAGE, exportable=True)
        fake.handles[h].data[:] = page_bytes(p)
        out.append(h)
    return out


@pytest.fixture
def cuda(fake: FakeDriver, handles: list[MemHandle]) -> CudaPageSpace:
    space = CudaPageSpace(fake, handles, PAGE, PAGE, LENGTH)
    assert fake.calls[-1] == ("address_reserve", space.address, LENGTH)
    assert space.address % PAGE == 0 and space.frames == FRAMES
    fake.calls.clear()
    return space


def test_cuda_maps_each_page_as_its_whole_chunk_and_grants_access_once(
    cuda: CudaPageSpace, fake: FakeDriver, handles: list[MemHandle]
) -> None:
    a, h = cuda.address, handles
    cuda.map(PAGE, [2, 3, 4, 9])
    assert fake.calls == [
        ("mem_map", a + 1 * PAGE, PAGE, h[2]),
        ("mem_map", a + 2 * PAGE, PAGE, h[3]),
        ("mem_map", a + 3 * PAGE, PAGE, h[4]),
        ("mem_map", a + 4 * PAGE, PAGE, h[9]),
        ("set_access", a + PAGE, 4 * PAGE),
    ]
    assert cuda.mapped_pages == 4
    for k, p in enumerate([2, 3, 4, 9]):
        assert fake.read(a + (1 + k) * PAGE, PAGE) == page_bytes(p)
    fake.write(a + 4 * PAGE + 10, b"nine")  # frame 9
    assert bytes(fake.handles[h[9]].data[10:14]) == b"nine"
    fake.calls.clear()
    cuda.unmap(PAGE, 4)
    assert fake.calls == [("mem_unmap", a + (1 + k) * PAGE, PAGE) for k in range(4)]
    assert cuda.mapped_pages == 0
    with pytest.raises(CudaError, match="ILLEGAL_ADDRESS"):
        fake.read(a + PAGE, 1)


def test_cuda_refuses_a_page_smaller_than_a_chunk_before_any_driver_call(
    fake: FakeDriver,
) -> None:
    chunks = [fake.mem_create(CHUNK, exportable=True) for _ in range(CHUNKS)]
    fake.calls.clear()
    with pytest.raises(ValueError, match="a page must be a whole chunk"):
        CudaPageSpace(fake, chunks, CHUNK, PAGE, LENGTH)
    assert fake.calls == []
    space = CudaPageSpace(fake, chunks, CHUNK, CHUNK, 4 * CHUNK)  # a page a chunk
    space.map(CHUNK, [2])
    assert fake.calls[-2:] == [
        ("mem_map", space.address + CHUNK, CHUNK, chunks[2]),
        ("set_access", space.address + CHUNK, CHUNK),
    ]
    space.close()


def test_cuda_round_trip_through_another_address(cuda: CudaPageSpace, fake: FakeDriver) -> None:
    data = bytes(range(256)) * (3 * PAGE // 256)
    cuda.map(0, [7, 8, 9])
    fake.write(cuda.address, data)
    cuda.unmap(0, 3)
    cuda.map(10 * PAGE, [9, 8, 7])  # the same frames, elsewhere and in another order
    back = b"".join(fake.read(cuda.address + (12 - k) * PAGE, PAGE) for k in range(3))
    assert back == data


def test_cuda_argument_errors_make_no_driver_call(cuda: CudaPageSpace, fake: FakeDriver) -> None:
    cuda.map(0, [0, 1])
    fake.calls.clear()
    for offset, frames in [(PAGE, [5]), (2 * PAGE, [4, 4]), (3, [5]), (0, [FRAMES])]:
        with pytest.raises(ValueError):
            cuda.map(offset, frames)
    for offset, count in [(PAGE, 1), (2 * PAGE, 1), (0, 3)]:
        with pytest.raises(ValueError):
            cuda.unmap(offset, count)
    assert fake.calls == []
    assert cuda.mapped_pages == 2


class FailingDriver(FakeDriver):
    """Fails the `fail_at`-th cuMemMap (1-based), or cuMemSetAccess when `fail_access`."""

    fail_at = 0
    fail_access = False

    def mem_map(self, ptr: DevicePtr, size: int, handle: MemHandle) -> None:
        if self.names().count("mem_map") + 1 == self.fail_at:
            raise CudaError("cuMemMap", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        super().mem_map(ptr, size, handle)

    def set_access(self, ptr: DevicePtr, size: int) -> None:
        if self.fail_access:
            raise CudaError("cuMemSetAccess", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        super().set_access(ptr, size)


@pytest.mark.parametrize("where", ["third map", "access"])
def test_cuda_map_is_all_or_nothing(where: str) -> None:
    fake = FailingDriver(granularity=PAGE)
    fake.open_device(0)
    h = [fake.mem_create(PAGE, exportable=True) for _ in range(4)]
    space = CudaPageSpace(fake, h, PAGE, PAGE, LENGTH)
    fake.calls.clear()
    fake.fail_at, fake.fail_access = (3, False) if where == "third map" else (0, True)
    with pytest.raises(CudaError):
        space.map(0, [0, 1, 3])
    a = space.address
    undo = [("mem_unmap", a + PAGE, PAGE), ("mem_unmap", a, PAGE)]
    if where == "access":
        undo = [("mem_unmap", a + 2 * PAGE, PAGE), *undo]
    assert [c for c in fake.calls if c[0] == "mem_unmap"] == undo
    assert space.mapped_pages == 0 and not fake.mappings
    fake.fail_at, fake.fail_access = 0, False
    space.map(0, [0, 1, 3])  # the same pages and frames are free again
    assert space.mapped_pages == 3


def test_cuda_retire_unmaps_everything_and_close_frees_the_range(
    cuda: CudaPageSpace, fake: FakeDriver, handles: list[MemHandle]
) -> None:
    a = cuda.address
    cuda.map(4 * PAGE, [5])
    cuda.map(0, [0, 8])
    fake.calls.clear()
    cuda.retire()
    assert sorted(fake.calls) == [
        ("mem_unmap", a, PAGE),
        ("mem_unmap", a + PAGE, PAGE),
        ("mem_unmap", a + 4 * PAGE, PAGE),
    ]
    assert cuda.mapped_pages == 0 and not fake.mappings
    with pytest.raises(RuntimeError, match="retired"):
        cuda.map(0, [0])
    cuda.close()
    assert fake.calls[-1] == ("address_free", a, LENGTH)
    cuda.close()  # idempotent
    for h in handles:
        fake.mem_release(h)
    fake.close_device()
    assert set(fake.live().values()) == {0}


def test_fake_driver_maps_granular_prefixes_of_an_allocation(fake: FakeDriver) -> None:
    h = fake.mem_create(CHUNK, exportable=False)
    base = fake.address_reserve(8 * PAGE, PAGE)
    for ptr, size in [
        (base, CHUNK + PAGE),  # past the allocation
        (base + PAGE // 2, PAGE),  # address not granular
        (base, PAGE // 2),  # size not granular
    ]:
        with pytest.raises(CudaError, match="INVALID_VALUE"):
            fake.mem_map(DevicePtr(ptr), size, h)
    fake.mem_map(base, 2 * PAGE, h)
    with pytest.raises(CudaError, match="INVALID_VALUE"):
        fake.mem_map(DevicePtr(base + PAGE), PAGE, h)  # over a mapping
    fake.set_access(base, 2 * PAGE)
    fake.write(base + PAGE, b"x")
    assert fake.handles[h].data[PAGE] == ord("x")
    with pytest.raises(CudaError, match="INVALID_VALUE"):
        fake.mem_unmap(DevicePtr(base), PAGE)  # part of a mapping
    fake.mem_unmap(base, 2 * PAGE)
    with pytest.raises(CudaError, match="INVALID_VALUE"):
        fake.mem_unmap(base, 2 * PAGE)  # not mapped
