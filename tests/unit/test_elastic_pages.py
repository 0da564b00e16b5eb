"""An elastic lease on the sim backend: frames added and withdrawn, memfd chunks added to and
dropped from a page space while pages stay mapped, a page moved onto another frame with its
bytes, Residency emptying the frames of chunks to give back, and a paged session growing and
giving chunks back while it runs: every block keeps its address and its bytes."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from tidalclient.devices.pages import CudaPageSpace, ElasticPages, Frames, SimPageSpace
from tidalclient.devices.streams import Stream
from tidalclient.errors import LeaseExceeded
from tidalclient.executors.base import DEVICE, HOST
from tidalclient.executors.paged import Paged, range_bytes
from tidalclient.executors.residency import Residency

from tests.unit.fake_cuda import FakeDriver
from tests.unit.test_paged_executor import paged_plan
from tests.unit.test_residency import Gate

PAGE = mmap.PAGESIZE * 4
PER_CHUNK = 4
CHUNK = PER_CHUNK * PAGE
_names = itertools.count()


def new_chunk(seed: int, pages: int = PER_CHUNK) -> tuple[int, str]:
    """A memfd chunk of `pages` pages whose page i holds `stamp(seed + i)`, and its unique
    name (as /proc shows it)."""
    name = f"test-elastic-{os.getpid()}-{next(_names)}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, pages * PAGE)
    for i in range(pages):
        os.pwrite(fd, stamp(seed + i), i * PAGE)
    return fd, name


def stamp(seed: int, n: int = PAGE) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(n))


def fds_open(name: str) -> int:
    """How many fds of this process are the memfd `name`."""
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        count += target.startswith(f"/memfd:{name} ")
    return count


def mapped_anywhere(name: str) -> bool:
    """Whether any mapping of this process shows the memfd `name`."""
    with open("/proc/self/maps") as f:
        return any(f"/memfd:{name} " in line for line in f)


def read(space: SimPageSpace, offset: int, n: int) -> bytes:
    return bytes(space.buffer(offset, n))


def write(space: SimPageSpace, offset: int, data: bytes) -> None:
    space.buffer(offset, len(data))[:] = data


# -- Frames -------------------------------------------------------------------------------------


def test_frames_grow_at_the_end_and_withdrawn_ones_never_come_back() -> None:
    f = Frames(4)
    assert f.take(2) == [0, 1]
    assert f.add(4) == range(4, 8)
    assert (f.count, f.usable, f.free) == (8, 8, 6)
    with pytest.raises(ValueError, match=r"^page 1 is taken$"):
        f.withdraw([2, 1])  # all or none: 2 stays free
    assert f.free == 6
    f.withdraw([2, 3])
    assert (f.count, f.usable, f.free) == (8, 6, 4)
    assert f.take(4) == [4, 5, 6, 7]  # 2 and 3 are not handed out
    assert f.take(1) is None
    assert not f.take_these([2])
    with pytest.raises(ValueError, match=r"^page 3 is withdrawn$"):
        f.give([3])
    with pytest.raises(ValueError, match=r"^page 2 is withdrawn$"):
        f.give([1, 2])  # a run with a withdrawn page: refused, nothing changed
    with pytest.raises(ValueError, match=r"^page 2 is withdrawn already$"):
        f.withdraw([2])
    with pytest.raises(ValueError, match=r"^page 8 is not a page of this lease \(0..7\)$"):
        f.withdraw([8])
    assert f.free == 0
    assert f.taken([0, 1, 5]) == 3
    with pytest.raises(ValueError, match=r"^page 3 is withdrawn$"):
        f.taken([3])
    f.give([4], parked=True)
    with pytest.raises(ValueError, match=r"^page 4 is parked: unmap the stale page"):
        f.withdraw([4])
    f.unpark(4)
    f.withdraw([4])
    f.give([0, 1])
    assert (f.usable, f.free) == (5, 2)
    assert f.add(2) == range(8, 10)
    assert f.take(4) == [0, 1, 8, 9]  # no run of four: two runs of two, none withdrawn
    with pytest.raises(ValueError, match="cannot add -1 pages"):
        f.add(-1)


# -- SimPageSpace as ElasticPages ---------------------------------------------------------------


@pytest.fixture
def two_chunks() -> Iterator[list[tuple[int, str]]]:
    """Two memfd chunks: frame p holds `stamp(p)`."""
    made = [new_chunk(0), new_chunk(PER_CHUNK)]
    yield made
    for fd, _ in made:
        os.close(fd)


def test_sim_adds_and_drops_chunks_and_refuses_their_frames_once_dropped(
    two_chunks: list[tuple[int, str]],
) -> None:
    space = SimPageSpace([fd for fd, _ in two_chunks], CHUNK, PAGE, 16 * PAGE)
    try:
        assert isinstance(space, ElasticPages)
        assert (space.slots, space.frames, space.per_chunk) == ([0, 1], 8, PER_CHUNK)
        fd, name = new_chunk(8)
        assert space.add_chunk(fd) == 2
        os.close(fd)  # the caller's own: the space keeps a duplicate
        assert fds_open(name) == 1
        assert (space.slots, space.frames) == ([0, 1, 2], 12)
        space.map(PAGE, [9])  # chunk 2, page 1
        assert read(space, PAGE, PAGE) == stamp(9)
        small, _ = new_chunk(0, pages=PER_CHUNK - 1)
        with pytest.raises(ValueError, match=rf"^chunk 3 holds {CHUNK - PAGE} bytes, fewer than"):
            space.add_chunk(small)
        os.close(small)
        with pytest.raises(ValueError, match=rf"^page 1 \(offset {PAGE}\) maps frame 9 of chunk 2"):
            space.drop_chunk(2)
        assert fds_open(name) == 1 and space.mapped_pages == 1
        space.unmap(PAGE, 1)
        space.drop_chunk(2)
        assert fds_open(name) == 0 and not mapped_anywhere(name)
        assert space.slots == [0, 1]
        with pytest.raises(ValueError, match=r"^frame 10 is of chunk 2, given back$"):
            space.map(0, [10])
        with pytest.raises(ValueError, match=r"^chunk 2 is not a chunk of this lease"):
            space.drop_chunk(2)
        fd, _ = new_chunk(20)
        assert space.add_chunk(fd) == 3  # a slot is never reused
        os.close(fd)
        assert (space.slots, space.frames) == ([0, 1, 3], 16)
        space.map(0, [12])
        assert read(space, 0, PAGE) == stamp(20)
    finally:
        space.close()


def test_sim_remap_moves_a_page_onto_another_frame_with_its_bytes(
    two_chunks: list[tuple[int, str]],
) -> None:
    (fd0, _), (fd1, name1) = two_chunks
    space = SimPageSpace([fd0, fd1], CHUNK, PAGE, 16 * PAGE)
    try:
        space.map(2 * PAGE, [1])
        data = stamp(77)
        write(space, 2 * PAGE, data)
        space.remap(2 * PAGE, 6)
        assert read(space, 2 * PAGE, PAGE) == data
        assert os.pread(fd1, PAGE, 2 * PAGE) == data  # frame 6: chunk 1, page 2
        write(space, 2 * PAGE, b"new")  # the page shows frame 6 now, not frame 1
        assert os.pread(fd1, 3, 2 * PAGE) == b"new"
        assert os.pread(fd0, PAGE, PAGE) == data
        assert space.mapped_pages == 1
        space.unmap(2 * PAGE, 1)
        space.map(0, [6])
        space.remap(0, 1)  # back onto chunk 0: chunk 1 may go now
        space.drop_chunk(1)
        assert read(space, 0, 3) == b"new" and not mapped_anywhere(name1)
        space.map(4 * PAGE, [2, 3])
        with pytest.raises(ValueError, match=r"^page 4 is not mapped by a map call of its own"):
            space.remap(4 * PAGE, 0)
        with pytest.raises(ValueError, match=r"^page 7 \(offset \d+\) is not mapped$"):
            space.remap(7 * PAGE, 0)
        with pytest.raises(ValueError, match=r"^frame 5 is of chunk 1, given back$"):
            space.remap(0, 5)
        with pytest.raises(ValueError, match=r"^frame 8 is outside the lease of 8 pages$"):
            space.remap(0, 8)
        assert read(space, 4 * PAGE, 2 * PAGE) == stamp(2) + stamp(3)
    finally:
        space.close()


def test_a_cuda_page_space_is_not_elastic() -> None:
    fake = FakeDriver(granularity=PAGE)
    fake.open_device(0)
    space = CudaPageSpace(fake, [fake.mem_create(PAGE, exportable=True)], PAGE, PAGE, 4 * PAGE)
    assert not isinstance(space, ElasticPages)
    ex = Paged(space, Frames(1), host_address=0, host_capacity=0, limit=PAGE)
    with pytest.raises(TypeError, match="CudaPageSpace has a fixed lease"):
        ex.add_chunks([0], PAGE)
    with pytest.raises(TypeError, match="fixed lease"):
        ex.give_back(1, PAGE)
    with pytest.raises(TypeError, match="cannot move a page"):
        ex.residency.vacate([0])
    ex.close()
    space.close()


# -- Residency.vacate -------------------------------------------------------------------------


class Pending:
    """A completion not done when asked, done once waited for."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def wait(self, timeout: float | None = None) -> bool:
        self.done = True
        return True


class Parts:
    def __init__(self, chunks: int, host_pages: int = 8) -> None:
        self.fds = [new_chunk(PER_CHUNK * k) for k in range(chunks)]
        self.space = SimPageSpace([fd for fd, _ in self.fds], CHUNK, PAGE, 32 * PAGE)
        self.host = mmap.mmap(-1, host_pages * PAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self.host))
        self.frames = Frames(chunks * PER_CHUNK)
        self.out, self.into = Stream("out"), Stream("in")
        self.r = Residency(self.space, self.frames, address, host_pages * PAGE, self.out, self.into)

    def close(self) -> None:
        self.r.close()
        self.out.close()
        self.into.close()
        self.space.close()
        for fd, _ in self.fds:
            os.close(fd)
        self.host.close()


@pytest.fixture
def parts() -> Iterator[Callable[[int], Parts]]:
    made: list[Parts] = []

    def make(chunks: int) -> Parts:
        made.append(Parts(chunks))
        return made[-1]

    yield make
    for p in made:
        p.close()


def books_agree(r: Residency, space: SimPageSpace, frames: Frames) -> None:
    """Every book of `r` agrees with what `space` maps and what `frames` holds."""
    shown = space._frame
    held = 0
    for h in r._held.values():
        for i, f in enumerate(h.frames):
            assert shown[h.offset // PAGE + i] == f
        held += len(h.frames)
    for p, (_, f) in r._packed.items():
        assert shown[p] == f
    held += len(r._packed)
    assert r.held_pages == held == frames.usable - frames.free
    for p, f in enumerate(r._shows):
        if f >= 0:
            assert shown[p] == f and not frames._gone[f]
    for f, p in enumerate(r._parked_for):
        if p >= 0:
            assert r._shows[p] == f and frames._free[f] == 2
    assert all(shown[p] == r._shows[p] for p in r._doomed)


def test_vacate_moves_owning_and_packed_pages_and_unmaps_stale_ones(
    parts: Callable[[int], Parts],
) -> None:
    p = parts(2)
    r, space, frames = p.r, p.space, p.frames
    assert r.place(5, 6 * PAGE, PAGE, owning=True)  # frame 0
    r.drop(5)  # page 6 stays mapped, stale, on frame 0 (parked)
    assert r.place(1, 0, 2 * PAGE, owning=True)  # frames 1, 2
    assert r.place(2, 10 * PAGE, 100, owning=False)  # a packed page: frame 3
    assert r.place(3, 10 * PAGE + 256, 300, owning=False)
    assert r.place(4, 4 * PAGE, PAGE, owning=True)  # frame 4, of chunk 1
    data = {1: stamp(11, 2 * PAGE), 2: stamp(12, 100), 3: stamp(13, 300), 4: stamp(14)}
    at = {1: 0, 2: 10 * PAGE, 3: 10 * PAGE + 256, 4: 4 * PAGE}
    for k, d in data.items():
        write(space, at[k], d)
    assert (space.mapped_pages, r.held_pages, frames.free) == (5, 4, 4)
    r.vacate(range(4))  # chunk 0: 1, 2, 3 beneath blocks, 0 under a stale page
    for k, d in data.items():
        assert read(space, at[k], len(d)) == d
    assert sorted([*r._held[1].frames, r._packed[10][1]]) == [5, 6, 7]
    assert r._held[4].frames == [4]
    assert (space.mapped_pages, r.held_pages, r.mapped_bytes) == (4, 4, 4 * PAGE)
    assert (frames.usable, frames.free) == (4, 0)
    books_agree(r, space, frames)
    space.drop_chunk(0)  # no page maps a frame of chunk 0 any more
    assert not mapped_anywhere(p.fds[0][1])
    # It runs on: a block leaves and comes back on the frames left, its bytes with it.
    assert r.evict(1)
    r.close()
    assert r.where(1) == HOST and r.held_pages == 2
    assert r.restore(1)
    r.close()
    assert read(space, 0, 2 * PAGE) == data[1] and r.where(1) == DEVICE
    assert set(r._held[1].frames) <= {5, 6, 7}
    r.drop(2)
    r.drop(3)
    books_agree(r, space, frames)


def test_vacate_waits_for_the_work_on_a_stale_page_another_block_took(
    parts: Callable[[int], Parts],
) -> None:
    p = parts(3)
    r, space, frames = p.r, p.space, p.frames
    pending = Pending()
    assert r.place(1, 0, PAGE, owning=True)  # frame 0
    r.drop(1, after=pending)  # stale at page 0; work may still use it
    assert r.place(2, 8 * PAGE, 11 * PAGE, owning=True)  # frames 1..11
    assert r.place(3, 20 * PAGE, PAGE, owning=True)  # frame 0, longest stale: page 0 doomed
    assert r._held[3].frames == [0] and r._doomed == {0}
    write(space, 20 * PAGE, stamp(3))
    r.drop(2)  # frames 1..11 free, parked for block 2's stale pages
    r.vacate(range(4))
    assert pending.done  # waited for before its page went
    assert read(space, 20 * PAGE, PAGE) == stamp(3)
    assert r._held[3].frames == [4]  # every free frame was parked: the longest stale's
    assert not r._doomed
    assert space._frame[0] == -1 and all(space._frame[8 + k] == -1 for k in range(4))
    assert (frames.usable, frames.free, r.held_pages) == (8, 7, 1)
    books_agree(r, space, frames)
    space.drop_chunk(0)


def test_vacate_without_room_or_with_a_copy_in_flight_changes_nothing(
    parts: Callable[[int], Parts],
) -> None:
    p = parts(2)
    r, space, frames = p.r, p.space, p.frames
    assert r.place(1, 0, 3 * PAGE, owning=True)  # frames 0..2
    assert r.place(2, 4 * PAGE, 3 * PAGE, owning=True)  # frames 3..5
    r.drop(2)
    assert r.place(3, 8 * PAGE, 2 * PAGE, owning=True)  # frames 6, 7
    mapped = space.mapped_pages
    with pytest.raises(LeaseExceeded, match="3 of them are beneath blocks, and 2 free pages"):
        r.vacate(range(4))  # 0..2 to move, and only 4 and 5 free outside chunk 0
    assert (space.mapped_pages, frames.usable, frames.free) == (mapped, 8, 3)
    books_agree(r, space, frames)
    out_gate = Gate(p.out)  # the copy out stays in flight until it opens
    try:
        assert r.evict(3)
        with pytest.raises(ValueError, match=r"copies are in flight \(1\): reclaim them first"):
            r.vacate(range(4, 8))
    finally:
        out_gate.open()
    r.close()
    r.vacate(range(4, 8))  # block 3 is away now: nothing to move
    assert (frames.usable, frames.free, r.held_pages) == (4, 1, 3)
    with pytest.raises(ValueError, match=r"^page 4 is withdrawn$"):
        r.vacate([4])
    books_agree(r, space, frames)


def test_grow_takes_in_the_frames_of_a_chunk_added(parts: Callable[[int], Parts]) -> None:
    p = parts(1)
    r, space, frames = p.r, p.space, p.frames
    assert r.place(1, 0, 4 * PAGE, owning=True)
    assert not r.place(2, 8 * PAGE, PAGE, owning=True)
    with pytest.raises(ValueError, match="add them to the frames first"):
        r.grow(PER_CHUNK)
    fd, _ = new_chunk(40)
    space.add_chunk(fd)
    os.close(fd)
    r.grow(len(frames.add(PER_CHUNK)))
    assert r.place(2, 8 * PAGE, 2 * PAGE, owning=True)
    assert r._held[2].frames == [4, 5] and read(space, 8 * PAGE, PAGE) == stamp(40)
    r.drop(2)  # its frames parked for its stale pages: the books of the new frames
    books_agree(r, space, frames)


# -- Paged ------------------------------------------------------------------------------------


class Session:
    """A paged executor over `chunks` memfd chunks of PER_CHUNK pages; `fds` (the caller's
    duplicates, kept open to look into the chunks) and their names by slot."""

    def __init__(self, chunks: int, limit_pages: int, host_pages: int = 16) -> None:
        made = [new_chunk(100 + PER_CHUNK * k) for k in range(chunks)]
        self.fds = [fd for fd, _ in made]
        self.names = [name for _, name in made]
        lease = chunks * CHUNK
        self.space = SimPageSpace(self.fds, CHUNK, PAGE, range_bytes(lease, PAGE))
        self.host = mmap.mmap(-1, host_pages * PAGE)
        self.ex = Paged(
            self.space,
            Frames(chunks * PER_CHUNK),
            host_address=ctypes.addressof(ctypes.c_char.from_buffer(self.host)),
            host_capacity=host_pages * PAGE,
            limit=limit_pages * PAGE,
        )

    def add(self, seed: int) -> int:
        fd, name = new_chunk(seed)
        self.fds.append(fd)
        self.names.append(name)
        return fd

    def close(self) -> None:
        self.ex.close()
        self.space.close()
        for fd in self.fds:
            os.close(fd)
        self.host.close()


@pytest.fixture
def sessions() -> Iterator[Callable[..., Session]]:
    made: list[Session] = []

    def make(chunks: int, limit_pages: int, host_pages: int = 16) -> Session:
        made.append(Session(chunks, limit_pages, host_pages))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_session_gives_a_chunk_back_and_grows_by_a_new_one_while_it_runs(
    sessions: Callable[..., Session],
) -> None:
    s = sessions(3, limit_pages=12)
    ex, space = s.ex, s.space
    a = ex.malloc(2 * PAGE)  # frames 0, 1
    b = ex.malloc(2 * PAGE)  # frames 2, 3
    small = [ex.malloc(1000), ex.malloc(1000)]  # one packed page: frame 4
    e = ex.malloc(3 * PAGE)  # frames 5, 6, 7
    d = ex.malloc(PAGE)  # frame 8, pinned
    ex.pin(d)
    blocks = [a, b, *small, d, e]
    data = {blk.id: stamp(blk.id, blk.size) for blk in blocks}
    for blk in blocks:
        write(space, blk.offset, data[blk.id])
    assert ex.swap_out(b)
    ex.synchronize()
    assert ex.where(b) == HOST and ex.used_bytes == 7 * PAGE

    def intact() -> None:
        for blk in blocks:
            (at,) = ex.begin_op([blk])
            assert at == blk.offset and read(space, at, blk.size) == data[blk.id]
            ex.end_op([blk])

    # Slot 2 holds one frame beneath a block (the pinned d's), slot 0 two, slot 1 four: d
    # moves onto a frame b left (a stale page of b's goes), and keeps its address and bytes.
    assert ex.give_back(1, 8 * PAGE) == [2]
    assert ex.where(d) == DEVICE and read(space, d.offset, PAGE) == data[d.id]
    assert ex.residency._held[d.id].frames[0] in (2, 3)
    assert ex.slots == [0, 1] and space.slots == [0, 1]
    assert fds_open(s.names[2]) == 1  # the caller's own alone: the space's duplicate is closed
    assert not mapped_anywhere(s.names[2])  # no page of the range shows chunk 2
    assert ex.capacity == ex.stats().swap.limit == 8 * PAGE
    assert ex.used_bytes == ex.stats().swap.resident_bytes == 7 * PAGE
    assert ex.largest_free == PAGE
    assert ex.where(b) == HOST  # nothing had to leave for 7 pages under 8
    intact()  # b comes back: a, least recently used, leaves for it
    assert ex.used_bytes <= 8 * PAGE and ex.where(a) == HOST
    x = ex.malloc(2 * PAGE)
    ex.step()
    assert ex.used_bytes <= 8 * PAGE
    ex.free(x)
    with pytest.raises(ValueError, match="frame 8 is of chunk 2, given back"):
        space.map(0, [8])

    fd = s.add(seed=200)
    assert ex.add_chunks([fd], 12 * PAGE) == [3]
    assert ex.slots == [0, 1, 3] and ex.capacity == 12 * PAGE
    intact()  # all 9 pages fit under 12: none leaves
    assert ex.used_bytes == 9 * PAGE and all(ex.where(blk) == DEVICE for blk in blocks)
    y = ex.malloc(3 * PAGE)  # every frame of slots 0, 1 and 3
    assert ex.used_bytes == 12 * PAGE and all(ex.where(blk) == DEVICE for blk in blocks)
    assert ex._frames.taken(range(12, 16)) == 4 and mapped_anywhere(s.names[3])
    blocks.append(y)
    data[y.id] = stamp(9, 3 * PAGE)
    write(space, y.offset, data[y.id])
    chunk_3 = os.pread(fd, CHUNK, 0)  # the bytes of blocks on it are in the chunk added
    pages = {
        p for blk in blocks for p in range(blk.offset // PAGE, -(-(blk.offset + blk.size) // PAGE))
    }
    shown = [read(space, p * PAGE, PAGE) for p in pages]
    assert sum(chunk_3[i * PAGE : (i + 1) * PAGE] in shown for i in range(4)) == 4
    intact()
    assert ex.stats().swap.limit == 12 * PAGE and ex.used_bytes == 12 * PAGE


def test_give_back_evicts_least_recently_used_blocks_until_the_rest_fits(
    sessions: Callable[..., Session],
) -> None:
    s = sessions(2, limit_pages=8)
    ex, space = s.ex, s.space
    a, b, c = (ex.malloc(2 * PAGE) for _ in range(3))  # frames 0..5
    for blk in (a, b, c):
        write(space, blk.offset, stamp(blk.id, 2 * PAGE))
    ex.begin_op([a])  # a is used last: b then c are the least recently used
    ex.end_op([a])
    # 6 pages over 4: b leaves; a and c hold two frames of each chunk, and the last slot goes:
    # c moves onto b's old frames.
    assert ex.give_back(1, 4 * PAGE) == [1]
    assert (ex.where(a), ex.where(b), ex.where(c)) == (DEVICE, HOST, DEVICE)
    assert ex.used_bytes == 4 * PAGE and ex.capacity == 4 * PAGE
    assert read(space, c.offset, 2 * PAGE) == stamp(c.id, 2 * PAGE)
    for blk in (a, b, c):
        (at,) = ex.begin_op([blk])
        assert read(space, at, 2 * PAGE) == stamp(blk.id, 2 * PAGE)
        ex.end_op([blk])
        assert ex.used_bytes <= 4 * PAGE
    assert not mapped_anywhere(s.names[1])


def test_give_back_says_why_it_cannot_and_changes_nothing(
    sessions: Callable[..., Session],
) -> None:
    s = sessions(2, limit_pages=8)
    ex, space = s.ex, s.space
    a, b = ex.malloc(3 * PAGE), ex.malloc(3 * PAGE)
    ex.pin(a)
    ex.begin_op([b])  # held by an op
    for blk in (a, b):
        write(space, blk.offset, stamp(blk.id, 3 * PAGE))
    with pytest.raises(LeaseExceeded, match=r"cannot give back 1 of the 2 chunks .* stay mapped"):
        ex.give_back(1, 8 * PAGE)
    with pytest.raises(LeaseExceeded, match="cannot give back all 2 chunks of the lease"):
        ex.give_back(2, 8 * PAGE)
    with pytest.raises(ValueError, match="cannot give back 3 of the lease's 2 chunks"):
        ex.give_back(3, 8 * PAGE)
    ex.end_op([b])
    assert ex.slots == [0, 1] and ex.capacity == 8 * PAGE and ex.used_bytes == 6 * PAGE
    assert ex.where(b) == DEVICE and ex.stats().swap.swap_outs == 0
    # With no room in the host lease, a block that could leave cannot either.
    t = sessions(2, limit_pages=8, host_pages=1)
    c = t.ex.malloc(3 * PAGE)
    t.ex.malloc(3 * PAGE)
    t.ex.pin(c)
    with pytest.raises(LeaseExceeded, match="the host lease has no room"):
        t.ex.give_back(1, 8 * PAGE)
    assert t.ex.slots == [0, 1] and t.ex.used_bytes == 6 * PAGE
    for blk in (a, b):
        assert read(space, blk.offset, 3 * PAGE) == stamp(blk.id, 3 * PAGE)


def test_set_limit_moves_the_limit_and_a_plan_made_for_more_stops(
    sessions: Callable[..., Session],
) -> None:
    s = sessions(2, limit_pages=8)
    ex = s.ex
    ex.install_plan(paged_plan(ex, [PAGE], [0], [True], (), 8 * PAGE))
    ex.step()
    a = ex.malloc(PAGE)
    assert ex.stats().mode == "planned" and a.offset == ex._region
    b, c = ex.malloc(2 * PAGE), ex.malloc(2 * PAGE)
    ex.set_limit(3 * PAGE)  # at once: a and b, least recently used, leave
    assert (ex.where(a), ex.where(b), ex.where(c)) == (HOST, HOST, DEVICE)
    assert ex.capacity == ex.stats().swap.limit == 3 * PAGE and ex.largest_free == PAGE
    assert ex.stats().mode == "learning"  # the plan was made for 8 pages
    ex.set_limit(100 * PAGE)  # at most the lease
    assert ex.capacity == 8 * PAGE and ex.largest_free == 6 * PAGE
    with pytest.raises(ValueError, match="under one page"):
        ex.set_limit(PAGE - 1)


def test_defer_runs_on_the_sessions_thread_at_its_next_call_in_order_once(
    sessions: Callable[..., Session],
) -> None:
    ex = sessions(2, limit_pages=8).ex
    ran: list[tuple[str, int]] = []

    def note(what: str) -> Callable[[Paged], None]:
        def fn(got: Paged) -> None:
            assert got is ex
            ran.append((what, threading.get_ident()))

        return fn

    other = threading.Thread(target=lambda: [ex.defer(note("one")), ex.defer(note("two"))])
    other.start()
    other.join()
    assert ran == []  # nothing runs on the thread that deferred
    me = threading.get_ident()
    a = ex.try_malloc(PAGE)
    assert ran == [("one", me), ("two", me)]
    assert a is not None
    ex.defer(note("op"))
    ex.begin_op([a])
    ex.end_op([a])
    ex.defer(note("step"))
    ex.step()
    ex.malloc(PAGE)
    assert [w for w, _ in ran] == ["one", "two", "op", "step"]

    def fail(_: Paged) -> None:
        raise RuntimeError("deferred failure")

    ex.defer(fail)
    ex.defer(lambda got: got.set_limit(2 * PAGE))
    with pytest.raises(RuntimeError, match="deferred failure"):
        ex.step()
    assert ex.capacity == 8 * PAGE  # what was deferred after it runs at the next call
    ex.begin_op([a])
    assert ex.capacity == 2 * PAGE
    ex.end_op([a])


def test_add_chunks_is_all_or_nothing(sessions: Callable[..., Session]) -> None:
    s = sessions(1, limit_pages=4)
    good = s.add(seed=50)
    short, _ = new_chunk(0, pages=1)
    with pytest.raises(ValueError, match="fewer than"):
        s.ex.add_chunks([good, short], 8 * PAGE)
    os.close(short)
    assert s.ex.slots == [0] and s.ex.capacity == 4 * PAGE
    assert fds_open(s.names[1]) == 1  # the caller's alone
    assert s.ex.add_chunks([good], 8 * PAGE) == [2]  # slot 1 was given back
    assert s.ex.capacity == 8 * PAGE
    blk = s.ex.malloc(8 * PAGE)
    assert read(s.space, blk.offset + 4 * PAGE, PAGE) == stamp(50)


def test_run_if_idle_runs_deferred_work_between_ops_never_inside_one(
    sessions: Callable[..., Session],
) -> None:
    ex = sessions(2, limit_pages=8).ex
    a = ex.malloc(PAGE)
    ran: list[int] = []
    ex.begin_op([a])
    ex.defer(lambda got: ran.append(threading.get_ident()))
    outcome: list[bool] = []
    other = threading.Thread(target=lambda: outcome.append(ex.run_if_idle(0.05)))
    other.start()
    other.join()
    assert outcome == [False] and ran == [] and ex.deferred == 1  # the op holds the executor
    ex.end_op([a])
    other = threading.Thread(target=lambda: outcome.append(ex.run_if_idle(5.0)))
    other.start()
    other.join()
    assert outcome == [False, True] and ran == [other.ident] and ex.deferred == 0


def test_a_plan_whose_mapped_peak_fits_a_lower_limit_runs_on(
    sessions: Callable[..., Session],
) -> None:
    ex = sessions(2, limit_pages=8).ex
    plan = paged_plan(ex, [PAGE], [0], [True], (), 8 * PAGE)
    assert plan.paging is not None
    ex.install_plan(replace(plan, paging=replace(plan.paging, mapped_peak=4 * PAGE)))
    ex.step()
    ex.malloc(PAGE)
    ex.set_limit(5 * PAGE)  # under the 8 pages it was made for, over the 4 it maps
    assert ex.stats().mode == "planned"
    ex.set_limit(3 * PAGE)
    assert ex.stats().mode == "learning"
