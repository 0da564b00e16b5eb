"""The paged executor on the sim backend: blocks keep their addresses for life, the mapped bytes
stay under the limit (the LRU cache while learning, a version-3 plan's schedule once one runs),
and a block's bytes survive its trips to the host lease."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator

import pytest
from tidalclient.devices.pages import Frames, SimPageSpace
from tidalclient.errors import InvalidBlock, LeaseExceeded
from tidalclient.executors.base import DEVICE, HOST
from tidalclient.executors.paged import Paged, range_bytes
from tidalclient.plans import Plan, PlanTable
from tidalcore.events import ALLOC, FREE
from tidalcore.planupdate import Pages, ScheduledSwap

PAGE = mmap.PAGESIZE * 4
LEASE_PAGES = 8
HOST_BYTES = 16 * PAGE


class Sink:
    """A trace sink that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int, int]] = []
        self.steps: list[tuple[int, tuple[tuple[int, int, bool], ...]]] = []

    def record(
        self, kind: int, block_id: int, size: int = 0, duration_ns: int = 0, name_id: int = 0
    ) -> None:
        self.events.append((kind, block_id, size))

    def step(self, iteration: int, live: object = ()) -> None:
        self.steps.append((iteration, tuple(live)))  # type: ignore[arg-type]


def make(limit_pages: int, sink: Sink | None = None) -> tuple[Paged, mmap.mmap]:
    fd = os.memfd_create("test-paged", os.MFD_CLOEXEC)
    os.ftruncate(fd, LEASE_PAGES * PAGE)
    space = SimPageSpace([fd], LEASE_PAGES * PAGE, PAGE, range_bytes(LEASE_PAGES * PAGE, PAGE))
    os.close(fd)
    host = mmap.mmap(-1, HOST_BYTES)
    address = ctypes.addressof(ctypes.c_char.from_buffer(host))
    ex = Paged(
        space,
        Frames(LEASE_PAGES),
        host_address=address,
        host_capacity=HOST_BYTES,
        limit=limit_pages * PAGE,
        trace=sink,
    )
    return ex, host


@pytest.fixture
def made() -> Iterator[list[tuple[Paged, mmap.mmap]]]:
    kept: list[tuple[Paged, mmap.mmap]] = []
    yield kept
    for ex, _ in kept:
        ex.close()


def executor(
    made: list[tuple[Paged, mmap.mmap]], limit_pages: int, sink: Sink | None = None
) -> Paged:
    pair = make(limit_pages, sink)
    made.append(pair)
    return pair[0]


def write(ex: Paged, block_offset: int, n: int, seed: int) -> bytes:
    data = bytes((seed + i) % 251 for i in range(n))
    ctypes.memmove(ex.space.address + block_offset, data, n)
    return data


def read(ex: Paged, block_offset: int, n: int) -> bytes:
    return ctypes.string_at(ex.space.address + block_offset, n)


def test_learning_keeps_the_mapped_pages_under_the_limit_and_addresses_for_life(made) -> None:
    ex = executor(made, limit_pages=4)
    a = ex.malloc(2 * PAGE)
    (at,) = ex.begin_op([a])
    data = write(ex, at, 2 * PAGE, 1)
    ex.end_op([a])
    b = ex.malloc(2 * PAGE)
    c = ex.malloc(2 * PAGE)  # over 4 pages: a, least recently used, leaves
    assert ex.where(a) != DEVICE
    assert ex.stats().swap.peak_resident_bytes <= 4 * PAGE
    (again,) = ex.begin_op([a])  # back at the same address, with its bytes
    assert again == at == a.offset
    assert read(ex, again, 2 * PAGE) == data
    ex.end_op([a])
    assert ex.used_bytes <= 4 * PAGE
    for blk in (a, b, c):
        ex.free(blk)
    ex.synchronize()  # a block freed while its copy out runs keeps its pages until it ends
    assert ex.used_bytes == 0


def test_small_blocks_share_pages_and_a_page_goes_with_its_last_block(made) -> None:
    ex = executor(made, limit_pages=4)
    small = [ex.malloc(1000) for _ in range(4)]
    assert ex.used_bytes == PAGE  # 4000 bytes packed on one page
    assert ex.swap_out(small[0]) is False  # a packed block never moves
    for blk in small[:3]:
        ex.free(blk)
    assert ex.used_bytes == PAGE
    ex.free(small[3])
    assert ex.used_bytes == 0


def test_when_nothing_can_leave_a_malloc_says_why(made) -> None:
    ex = executor(made, limit_pages=2)
    a = ex.malloc(2 * PAGE)
    ex.begin_op([a])  # held by an op: it cannot leave
    with pytest.raises(LeaseExceeded, match="mapped of the limit"):
        ex.malloc(PAGE)
    assert ex.try_malloc(PAGE) is None
    ex.end_op([a])
    assert ex.try_malloc(PAGE) is not None  # now a can leave


def test_each_step_tells_where_the_live_blocks_lie_while_learning(made) -> None:
    sink = Sink()
    ex = executor(made, limit_pages=8, sink=sink)
    w = ex.malloc(2 * PAGE)
    v = ex.malloc(100)
    t = ex.malloc(PAGE)
    ex.free(t)
    ex.step()
    assert sink.steps == [(1, ((w.id, w.offset, True), (v.id, v.offset, False)))]
    assert w.offset % PAGE == 0
    assert (ALLOC, t.id, PAGE) in sink.events and (FREE, t.id, 0) in sink.events
    with pytest.raises(InvalidBlock):
        ex.free(t)


def paged_plan(
    ex: Paged,
    sizes: list[int],
    addresses: list[int],
    owning: list[bool],
    swaps: tuple[ScheduledSwap, ...],
    limit: int,
    page: int = PAGE,
) -> Plan:
    region = -(-max(a + s for a, s in zip(addresses, sizes, strict=True)) // page) * page
    table = PlanTable.build(7, sizes, addresses, region, ex.alignment)
    pages = Pages(page, tuple(addresses), tuple(owning), region, limit)
    return Plan(table, swaps, version=3, limit=limit, paging=pages)


def test_a_paged_plan_places_its_allocations_and_runs_its_swaps(made) -> None:
    ex = executor(made, limit_pages=4)
    w = ex.malloc(2 * PAGE)  # persistent: keeps its address
    ex.step()
    # Allocation 0 (2 pages) leaves after op 0 and is back before op 2; allocation 1 (2 pages)
    # lives over op 1 only: 2 (w) + 2 + 2 pages would be 6 mapped without the swap.
    swap = ScheduledSwap(block=0, out_after=0, in_before=2, in_at=2)
    plan = paged_plan(ex, [2 * PAGE, 2 * PAGE], [0, 2 * PAGE], [True, True], (swap,), 4 * PAGE)
    ex.install_plan(plan)
    for _ in range(3):
        ex.step()
        x = ex.malloc(2 * PAGE)
        assert x.offset == ex._region  # the plan's address, in its region
        (at,) = ex.begin_op([x])
        data = write(ex, at, 2 * PAGE, 3)
        ex.end_op([x])  # op 0: x leaves
        ex.begin_op([w])  # op 1: w, while x's pages go and y arrives
        y = ex.malloc(2 * PAGE)
        assert y.offset == ex._region + 2 * PAGE
        ex.end_op([w])
        ex.free(y)
        (back,) = ex.begin_op([x])  # op 2: x is back, same address, same bytes
        assert back == at and read(ex, back, 2 * PAGE) == data
        ex.end_op([x])
        ex.free(x)
    s = ex.stats()
    assert s.mode == "planned" and s.plan_hits == 6 and s.plan_misses == 0
    assert s.swap.planned_out_bytes == s.swap.planned_in_bytes == 3 * 2 * PAGE
    assert s.swap.on_demand_out_bytes == s.swap.on_demand_in_bytes == 0
    assert s.swap.peak_resident_bytes <= 4 * PAGE
    assert ex.where(w) == DEVICE


def test_an_allocation_the_plan_did_not_foresee_is_placed_online(made) -> None:
    ex = executor(made, limit_pages=8)
    ex.install_plan(paged_plan(ex, [PAGE], [0], [True], (), 8 * PAGE))
    ex.step()
    a = ex.malloc(2 * PAGE)  # another size than allocation 0's
    assert a.offset < ex._region
    assert ex.stats().plan_misses == 1


@pytest.mark.parametrize(
    ("page", "limit", "why"),
    [(2 * PAGE, 4 * PAGE, "pages are of"), (PAGE, 9 * PAGE, "over this session's limit")],
)
def test_a_plan_the_session_cannot_run_is_refused_with_the_reason(
    made, caplog, page, limit, why
) -> None:
    ex = executor(made, limit_pages=8)
    ex.install_plan(paged_plan(ex, [2 * PAGE], [0], [True], (), limit, page))
    ex.step()
    assert ex.plans_refused == 1 and ex.stats().mode == "learning"
    assert why in caplog.text


def test_a_contiguous_plan_is_not_run_by_a_paged_session(made, caplog) -> None:
    ex = executor(made, limit_pages=8)
    table = PlanTable.build(3, [PAGE], [0], PAGE, ex.alignment)
    ex.install_plan(Plan(table, version=2, limit=8 * PAGE))
    ex.step()
    assert ex.plans_refused == 1 and "not a paged plan" in caplog.text


def test_a_block_freed_while_its_copy_runs_gives_everything_back(made) -> None:
    ex = executor(made, limit_pages=4)
    a = ex.malloc(2 * PAGE)
    assert ex.swap_out(a)
    ex.free(a)  # its copy may still run: pages and host bytes go when it ends
    ex.synchronize()
    assert ex.used_bytes == 0
    assert ex.stats().swap.host_used_bytes == 0
    assert ex.where(ex.malloc(PAGE)) == DEVICE


def test_prefetch_brings_a_block_back_without_an_op(made) -> None:
    ex = executor(made, limit_pages=4)
    a = ex.malloc(2 * PAGE)
    assert ex.swap_out(a)
    ex.synchronize()
    assert ex.where(a) == HOST and ex.used_bytes == 0
    ex.prefetch(a)
    ex.synchronize()
    assert ex.where(a) == DEVICE and ex.used_bytes == 2 * PAGE


def test_a_later_plan_lies_past_the_live_blocks_of_the_one_before(made) -> None:
    sink = Sink()
    ex = executor(made, limit_pages=8, sink=sink)
    ex.install_plan(paged_plan(ex, [2 * PAGE], [0], [True], (), 8 * PAGE))
    ex.step()
    keep = ex.malloc(2 * PAGE)  # the plan's allocation 0, at its region's start
    assert keep.offset == ex._region
    ex.install_plan(paged_plan(ex, [PAGE], [0], [True], (), 8 * PAGE))
    ex.step()  # keep lives on, at its address: the next step mark says where
    assert sink.steps[-1] == (2, ((keep.id, keep.offset, True),))
    b = ex.malloc(PAGE)
    assert b.offset == ex._region + 2 * PAGE  # past keep: no block moves
    assert ex.stats().plan_hits == 2 and ex.stats().plan_misses == 0


def test_a_plan_switched_to_within_an_iteration_catches_up_with_its_schedule(made) -> None:
    """`switch_plan` after ops and before the iteration's first allocation: a persistent block
    the new plan has away by then leaves, one it keeps that the plan before sent away comes
    back (bytes intact), and allocating first makes a switch a RuntimeError."""
    ex = executor(made, limit_pages=8)
    w = ex.malloc(2 * PAGE)  # persistent
    v = ex.malloc(2 * PAGE)  # persistent
    (at,) = ex.begin_op([v])
    data = write(ex, at, 2 * PAGE, 5)
    ex.end_op([v])
    ex.step()
    # Plan a: w leaves after op 0 and is back before op 3. Plan b: v leaves after op 0 and is
    # back before op 3. Both place one allocation of a page.
    away_w = ScheduledSwap(block=w.id, out_after=0, in_before=3, persistent=True)
    away_v = ScheduledSwap(block=v.id, out_after=0, in_before=3, persistent=True)
    a = paged_plan(ex, [PAGE], [0], [True], (away_w,), 8 * PAGE)
    b = paged_plan(ex, [PAGE], [0], [True], (away_v,), 8 * PAGE)
    ex.install_plan(a)
    ex.step()
    for _ in range(2):  # ops 0 and 1 under a: w leaves after op 0
        ex.begin_op([v])
        ex.end_op([v])
    ex.synchronize()
    assert (ex.where(w), ex.where(v)) == (HOST, DEVICE)
    ex.switch_plan(b)  # the iteration is b's: v leaves, w (b keeps it) comes back
    ex.synchronize()
    assert (ex.where(w), ex.where(v)) == (DEVICE, HOST)
    x = ex.malloc(PAGE)
    assert x.offset == ex._region  # b's slot
    with pytest.raises(RuntimeError, match="allocated already"):
        ex.switch_plan(a)
    (again,) = ex.begin_op([v])
    assert read(ex, again, 2 * PAGE) == data
    ex.end_op([v])
    ex.free(x)
