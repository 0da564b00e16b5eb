"""Residency on the sim backend: pages mapped beneath blocks that keep their addresses, swaps
that unmap a block's pages once its copy out is done and map any free pages on its way back,
and exactly the mapped bytes the planner counts for the same layout."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator

import pytest
from tidalclient.devices.pages import Frames, SimPageSpace
from tidalclient.devices.streams import Event, Stream
from tidalclient.executors.base import ARRIVING, DEVICE, HOST, LEAVING
from tidalclient.executors.residency import Residency
from tidalclient.timeline import HOST_TRACK, WAIT, Timeline
from tidalcore.units import Tick
from tidalplan import paged
from tidalplan.model import Swap, SwapPlan
from tidalplan.simulate import simulate

from .iterations import paged_pair

PAGE = mmap.PAGESIZE * 4
FRAMES = 8
LENGTH = 32 * PAGE
HOST_BYTES = 8 * PAGE


class Gate:
    """A stream's work held back until `open()`: copies issued meanwhile stay in flight."""

    def __init__(self, stream: Stream) -> None:
        self.event = Event()
        stream.launch(lambda: self.event.wait())

    def open(self) -> None:
        if not self.event.query():
            self.event._complete()


@pytest.fixture
def gates() -> Iterator[list[Gate]]:
    """Gates a test made, opened at its end whatever happened (a test never hangs on one)."""
    made: list[Gate] = []
    yield made
    for gate in made:
        gate.open()


@pytest.fixture
def parts() -> Iterator[tuple[Residency, Frames, Stream, Stream]]:
    fd = os.memfd_create("test-residency", os.MFD_CLOEXEC)
    os.ftruncate(fd, FRAMES * PAGE)
    space = SimPageSpace([fd], FRAMES * PAGE, PAGE, LENGTH)
    os.close(fd)
    host = mmap.mmap(-1, HOST_BYTES)
    host_address = ctypes.addressof(ctypes.c_char.from_buffer(host))
    frames = Frames(FRAMES)
    out, into = Stream("out"), Stream("in")
    r = Residency(space, frames, host_address, HOST_BYTES, out, into)
    yield r, frames, out, into
    r.close()
    out.close()
    into.close()
    space.close()
    del host_address
    host.close()


def fill(r: Residency, offset: int, n: int, seed: int) -> bytes:
    data = bytes((seed + i) % 251 for i in range(n))
    ctypes.memmove(r.space.address + offset, data, n)
    return data


def read(r: Residency, offset: int, n: int) -> bytes:
    return ctypes.string_at(r.space.address + offset, n)


def test_owning_blocks_map_whole_pages_and_packed_ones_share_theirs(
    parts: tuple[Residency, Frames, Stream, Stream],
) -> None:
    r, frames, _, _ = parts
    assert r.place(1, 0, 2 * PAGE + 1, owning=True)  # three pages of its own
    assert r.mapped_bytes == 3 * PAGE and frames.free == FRAMES - 3
    assert r.place(2, 10 * PAGE, 100, owning=False)
    assert r.place(3, 10 * PAGE + 256, PAGE, owning=False)  # the same page, and the next
    assert r.mapped_bytes == 5 * PAGE
    r.drop(2)
    assert r.mapped_bytes == 5 * PAGE  # block 3 is still on both
    r.drop(3)
    assert r.mapped_bytes == 3 * PAGE and frames.free == FRAMES - 3
    r.drop(1)
    assert r.mapped_bytes == 0 and frames.free == FRAMES
    assert r.peak_mapped_bytes == 5 * PAGE


def test_a_block_placed_where_a_freed_one_was_takes_its_mapping_as_it_is(
    parts: tuple[Residency, Frames, Stream, Stream],
) -> None:
    r, frames, _, _ = parts
    assert r.place(1, 0, 2 * PAGE, owning=True)
    data = fill(r, 0, 2 * PAGE, seed=3)
    r.drop(1)  # its frames are free at once; its addresses stay mapped, stale
    assert frames.free == FRAMES and r.space.mapped_pages == 2
    assert r.place(2, 4 * PAGE, 2 * PAGE, owning=True)  # parked frames are handed out last
    assert r.place(3, 0, 2 * PAGE, owning=True)
    assert read(r, 0, 2 * PAGE) == data  # the same frames, mapped as they were: no call
    assert r.space.mapped_pages == 4 and frames.free == FRAMES - 4
    r.drop(3)
    r.drop(2)
    # Page by page: page 1 keeps block 3's stale frame, page 2 gets a free one.
    assert r.place(4, PAGE, 2 * PAGE, owning=True)
    assert r.mapped_bytes == 2 * PAGE
    assert r.space.mapped_pages == 5  # and pages 0, 4 and 5 stale, their frames free
    assert r.place(5, 8 * PAGE, 6 * PAGE, owning=True)  # every free frame, theirs too
    # Their frames were taken, and no work used them (no compute stream): the stale pages
    # went then, so no address shows another block's bytes.
    assert r.space.mapped_pages == 8 and r.mapped_bytes == 8 * PAGE


def test_a_block_that_does_not_fit_changes_nothing(
    parts: tuple[Residency, Frames, Stream, Stream],
) -> None:
    r, frames, _, _ = parts
    assert r.place(1, 0, 6 * PAGE, owning=True)
    assert not r.place(2, 8 * PAGE, 3 * PAGE, owning=True)
    assert not r.place(3, 16 * PAGE, 3 * PAGE - 10, owning=False)
    assert r.mapped_bytes == 6 * PAGE and frames.free == 2
    with pytest.raises(ValueError, match="not on a page"):
        r.place(4, 100, PAGE, owning=True)
    with pytest.raises(ValueError, match="not in the range"):
        r.place(5, LENGTH - 10, 100, owning=False)
    with pytest.raises(ValueError, match="only page-owning blocks move"):
        assert r.place(6, 20 * PAGE, 10, owning=False)
        r.evict(6)


def test_a_swap_keeps_the_address_and_the_bytes_on_other_pages(
    parts: tuple[Residency, Frames, Stream, Stream], gates: list[Gate]
) -> None:
    r, frames, out, _ = parts
    assert r.place(1, 4 * PAGE, 2 * PAGE, owning=True)
    data = fill(r, 4 * PAGE, 2 * PAGE, seed=7)
    gate = Gate(out)
    gates.append(gate)
    assert r.evict(1)
    r.poll()
    assert r.where(1) == LEAVING and r.mapped_bytes == 2 * PAGE  # the copy has not run
    gate.open()
    out.synchronize()
    r.poll()
    assert r.where(1) == HOST and r.mapped_bytes == 0 and frames.free == FRAMES
    # Its frames go to another block before it comes back: it returns on other pages.
    assert r.place(2, 0, 2 * PAGE, owning=True)
    fill(r, 0, 2 * PAGE, seed=99)
    assert r.restore(1)
    assert r.where(1) == ARRIVING
    event = r.ready(1)
    assert event is not None and event.wait(timeout=30)
    assert read(r, 4 * PAGE, 2 * PAGE) == data
    r.poll()
    assert r.where(1) == DEVICE and r.ready(1) is None
    assert (r.out_bytes, r.in_bytes, r.swap_outs, r.swap_ins) == (2 * PAGE, 2 * PAGE, 1, 1)


def test_back_before_its_copy_out_ends_it_just_stays(
    parts: tuple[Residency, Frames, Stream, Stream], gates: list[Gate]
) -> None:
    r, frames, out, _ = parts
    assert r.place(1, 0, PAGE, owning=True)
    data = fill(r, 0, PAGE, seed=3)
    gate = Gate(out)
    gates.append(gate)
    assert r.evict(1)
    with pytest.raises(ValueError, match="block 1 is leaving: restore it first"):
        r.ready(1)
    assert r.restore(1)  # still leaving: nothing to copy in
    assert r.where(1) == DEVICE and r.in_bytes == 0 and r.ready(1) is None
    gate.open()
    r.close()
    assert r.where(1) == DEVICE and r.mapped_bytes == PAGE and read(r, 0, PAGE) == data
    assert frames.free == FRAMES - 1


def test_restore_waits_for_pages_that_reclaim_frees(
    parts: tuple[Residency, Frames, Stream, Stream], gates: list[Gate]
) -> None:
    r, frames, out, _ = parts
    assert r.place(1, 0, 4 * PAGE, owning=True)
    assert r.place(2, 8 * PAGE, 4 * PAGE, owning=True)
    data = fill(r, 8 * PAGE, 4 * PAGE, seed=11)
    assert r.evict(2)
    r.close()  # block 2 is on the host now, and its pages are block 3's
    assert r.place(3, 16 * PAGE, 4 * PAGE, owning=True) and frames.free == 0
    gate = Gate(out)
    gates.append(gate)
    assert r.evict(1)
    assert not r.restore(2)  # block 1's pages are still its own while its copy runs
    assert r.where(2) == HOST
    gate.open()
    assert r.reclaim() and frames.free == 4
    assert r.restore(2)
    r.close()
    assert read(r, 8 * PAGE, 4 * PAGE) == data
    assert not r.reclaim()


def test_a_block_freed_while_its_copy_runs_lets_go_once_it_ends(
    parts: tuple[Residency, Frames, Stream, Stream], gates: list[Gate]
) -> None:
    r, frames, out, _ = parts
    assert r.place(1, 0, 3 * PAGE, owning=True)
    gate = Gate(out)
    gates.append(gate)
    assert r.evict(1)
    r.drop(1)
    assert frames.free == FRAMES - 3  # the copy still reads them
    gate.open()
    r.close()
    assert frames.free == FRAMES and r.mapped_bytes == 0


def test_run_as_the_planner_counted_it_the_pages_match_its_count(
    parts: tuple[Residency, Frames, Stream, Stream],
) -> None:
    """A plan's layout and schedule, executed event by event: the frames held after every
    tick are what `validate_pages` counts for that tick, and never above the limit."""
    r, _, _, _ = parts
    it = paged_pair(PAGE // 1024)  # the paged tests' iteration, in pages of PAGE
    lay = paged.layout(it, PAGE, max_waste=0.05)
    limit = (4 + 3 + 1) * PAGE
    plan = SwapPlan((Swap(block=0, out_after=Tick(2), in_before=Tick(8), persistent=True),))
    result = simulate(paged.paged(it, lay), plan, limit, 1e6, 1e6)
    assert result.feasible
    assert paged.validate_pages(it, lay, plan, result, limit) == limit
    keys = {b.id: i for i, b in enumerate(it.blocks)}
    for k, (pid, size) in enumerate(it.persistent):
        assert r.place(pid, lay.persistent_addresses[k], size, lay.persistent_owning[k])
    (gone, back), swap = result.swap_ticks[0], plan.swaps[0]
    w = it.persistent[swap.block][0]
    data = fill(r, lay.persistent_addresses[0], it.persistent[0][1], seed=5)
    for t in range(it.ticks):
        if t == back:
            assert r.restore(w)
            r.close()
        for i, b in enumerate(it.blocks):
            if b.start == t:
                assert r.place(b.id, lay.addresses[i], b.size, lay.owning[i])
            if b.end == t:
                r.drop(b.id)
        if t == swap.out_after:
            assert r.evict(w)
        if t == gone:
            r.close()  # the copy out was done by this tick in the simulation
        assert r.mapped_bytes <= limit
    assert r.peak_mapped_bytes == limit
    assert read(r, lay.persistent_addresses[0], it.persistent[0][1]) == data
    assert keys  # every block was placed by its own address


def test_a_stale_page_work_may_still_read_goes_only_once_that_work_is_done(
    parts: tuple[Residency, Frames, Stream, Stream], gates: list[Gate]
) -> None:
    r, frames, _, _ = parts
    compute = Stream("compute")
    gate = Gate(compute)
    gates.append(gate)
    after = compute.record()  # the work that last used block 1: held back by the gate
    try:
        assert r.place(1, 0, 2 * PAGE, owning=True)
        r.drop(1, after)  # its frames are free at once; its pages stay mapped, stale
        assert frames.free == FRAMES
        assert r.place(2, 8 * PAGE, FRAMES * PAGE, owning=True)  # every frame: block 1's too
        assert r.space.mapped_pages == FRAMES + 2  # block 1's pages: its work may still run
        r.poll()
        assert r.space.mapped_pages == FRAMES + 2
        gate.open()
        after.wait()
        r.poll()  # that work is done: they go
        assert r.space.mapped_pages == FRAMES
    finally:
        gate.open()
        compute.close()


class _Pending:
    """A completion not done when asked, done once waited for."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def wait(self, timeout: float | None = None) -> bool:
        self.done = True
        return True


def test_every_wait_is_a_stall_and_a_span_on_the_timeline(
    parts: tuple[Residency, Frames, Stream, Stream],
) -> None:
    r, _, out, into = parts
    r.timeline = t = Timeline()
    assert out.timeline is t and into.timeline is t  # the copies go on it too
    r.wait(_Pending(), "copy in, for an op")
    done = _Pending()
    done.done = True
    r.wait(done, "nothing to wait for")  # already complete: no stall, no span
    [span] = t.spans
    assert span.track == HOST_TRACK and span.name == WAIT + "copy in, for an op"
    assert r.stall_ns == span.end_ns - span.start_ns >= 0
