"""The PlanUpdate codec both ends share: what `write` puts on the wire `read` gives back, and
`read` names the first column no session could run; the client runs only what it reads."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from tidalclient.plans import PlanRejected, decode
from tidalcore import planupdate
from tidalcore.planupdate import (
    Arena,
    Columns,
    Pages,
    PlanError,
    Prediction,
    Recompute,
    ScheduledSwap,
)
from tidalcore.v1 import pool_pb2

PAGE = 1024
PREDICTION = Prediction(7000, 5000, 4096, 4096, 100, 8192, 8192, 12.5)

ARENA = Columns(
    plan_id=4,
    version=planupdate.ARENA_VERSION,
    sizes=(1024, 512, 2048),
    placement=Arena(
        offsets=(0, 1024, 1536), height=3584, swap_in_offsets=(0,), resident_persistent=4096
    ),
    swaps=(ScheduledSwap(block=0, out_after=0, in_before=3, in_at=2),),
    swap_in_ticks=(5,),
    recomputes=(Recompute(block=1, drop_after=1, before=3),),
    limit=8192,
    signature=b"\x01" * 16,
    prediction=PREDICTION,
)

PAGED = Columns(
    plan_id=5,
    version=planupdate.PAGED_VERSION,
    sizes=(2048, 300, 1000),
    placement=Pages(
        page=PAGE,
        addresses=(0, 2048, 2560),
        owning=(True, False, False),
        region_bytes=4096,
        mapped_peak=4096,
    ),
    swaps=(
        ScheduledSwap(block=0, out_after=0, in_before=3, in_at=2),
        ScheduledSwap(block=9, out_after=3, in_before=1, in_at=0, persistent=True),
    ),
    swap_in_ticks=(4, 0),
    limit=4096,
    signature=b"\x02" * 16,
    prediction=PREDICTION,
)


@pytest.mark.parametrize("columns", [ARENA, PAGED], ids=["arena", "pages"])
def test_read_gives_back_what_write_wrote(columns: Columns) -> None:
    update = planupdate.write(columns)
    assert planupdate.read(update, ops=4) == columns
    again = pool_pb2.PlanUpdate.FromString(update.SerializeToString())
    assert planupdate.read(again) == columns


def test_a_newer_version_is_read_as_the_newest_known() -> None:
    update = planupdate.write(PAGED)
    update.version = planupdate.VERSION + 1
    assert planupdate.read(update).placement == PAGED.placement


def test_an_empty_update_is_an_empty_plan() -> None:
    c = planupdate.read(pool_pb2.PlanUpdate(plan_id=7))
    assert (c.version, c.sizes, c.swaps, c.placement) == (1, (), (), Arena((), 0))


Change = Callable[[pool_pb2.PlanUpdate], object]


def _set(field: str, value: int) -> Change:
    return lambda u: setattr(u, field, value)


def _item(field: str, k: int, value: int) -> Change:
    return lambda u: getattr(u, field).__setitem__(k, value)


ARENA_FAULTS: list[tuple[Change, str]] = [
    (lambda u: u.offsets.pop(), "2 offsets for 3 allocations"),
    (lambda u: u.swap_in_before.append(3), r"the swap columns differ in length: .* 1, 1, 1, 1, 2"),
    (lambda u: u.swap_in_offsets.append(0), r"the swap columns \(swap_in_offsets included\)"),
    (lambda u: u.swap_in_ticks.append(0), r"the swap columns \(swap_in_ticks included\)"),
    (_item("swap_blocks", 0, 3), r"swap_blocks\[0\] = 3: the iteration has 3 allocations"),
    (_item("swap_in_at", 0, 4), r"swap_in_at\[0\] = 4: the iteration has 4 ops"),
    (lambda u: u.recompute_before.pop(), "the recompute columns differ in length"),
    (_item("recompute_blocks", 0, 5), r"recompute_blocks\[0\] = 5: the iteration has 3 alloc"),
    (_item("recompute_before", 0, 4), r"recompute_before\[0\] = 4: the iteration has 4 ops"),
]

PAGED_FAULTS: list[tuple[Change, str]] = [
    (_set("page_bytes", 768), "page_bytes 768 is not a power of two of at least 256 bytes"),
    (_set("page_bytes", 128), "page_bytes 128 is not a power of two of at least 256 bytes"),
    (lambda u: u.addresses.append(0), "4 addresses for 3 allocations"),
    (lambda u: u.owning.pop(), "2 owning for 3 allocations"),
    (_set("region_bytes", 4000), "region_bytes 4000 is not whole pages of 1024 bytes"),
    (_item("addresses", 0, 256), r"addresses\[0\] = 256: allocation 0 owns pages but lies off"),
    (_item("addresses", 1, 100), r"addresses\[1\] = 100: allocation 1 shares pages but lies off"),
    (_item("addresses", 2, 3328), r"allocation 2 ends at 4328, past the region's 4096 bytes"),
    (lambda u: u.offsets.extend([0, 0, 0]), "offsets is set: version 3 places blocks by"),
    (_set("height_bytes", 4096), "height_bytes is set"),
    (lambda u: u.swap_in_ticks.pop(), r"the swap columns \(swap_in_ticks included\)"),
    (lambda u: u.recompute_blocks.append(2), "the recompute columns differ in length"),
    (_item("swap_blocks", 0, 1), r"swap_blocks\[0\] = 1: the allocation shares pages"),
]


@pytest.mark.parametrize(
    ("columns", "change", "message"),
    [(ARENA, c, m) for c, m in ARENA_FAULTS] + [(PAGED, c, m) for c, m in PAGED_FAULTS],
)
def test_read_names_the_column_no_session_could_run(
    columns: Columns, change: Change, message: str
) -> None:
    update = planupdate.write(columns)
    change(update)
    with pytest.raises(PlanError, match=message):
        planupdate.read(update, ops=4)


def test_a_paged_plan_carries_no_recomputation() -> None:
    update = planupdate.write(PAGED)
    update.recompute_blocks.append(2)
    update.recompute_drop_after.append(0)
    update.recompute_before.append(2)
    with pytest.raises(PlanError, match="recompute_blocks is set: a paged plan only swaps"):
        planupdate.read(update)


def test_op_indices_are_checked_only_where_the_ops_are_known() -> None:
    update = planupdate.write(ARENA)
    update.swap_in_before[0] = 9
    assert planupdate.read(update).swaps[0].in_before == 9
    with pytest.raises(PlanError, match=r"swap_in_before\[0\] = 9: the iteration has 4 ops"):
        planupdate.read(update, ops=4)


def test_check_swaps_names_a_swap_in_issued_after_its_use() -> None:
    planupdate.check_swaps(PAGED.swaps)
    late = ScheduledSwap(block=0, out_after=0, in_before=2, in_at=3)
    with pytest.raises(PlanError, match=r"swap 1: .*issued between the out and in ops"):
        planupdate.check_swaps([PAGED.swaps[0], late])
    crossing = ScheduledSwap(block=0, out_after=3, in_before=1, in_at=0)
    with pytest.raises(PlanError, match=r"swap 0: .*only a persistent block may cross"):
        planupdate.check_swaps([crossing])


def test_the_client_runs_what_it_reads() -> None:
    plan = decode(planupdate.write(PAGED))
    assert plan.paging == PAGED.placement and plan.swaps == PAGED.swaps
    assert (plan.table.offsets, plan.table.height) == ((0, 2048, 2560), 4096)
    assert (plan.swap_in_ticks, plan.limit, plan.prediction) == ((4, 0), 4096, PREDICTION)
    plan = decode(planupdate.write(ARENA))
    assert plan.paging is None and plan.swap_in_offsets == (0,)
    assert plan.recomputes == ARENA.recomputes and plan.table.height == 3584


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_item("swap_in_at", 0, 0), r"plan 4: swap 0: .*issued between the out and in ops"),
        (lambda u: u.swap_in_ticks.append(1), r"plan 4: the swap columns"),
        (_item("swap_in_offsets", 0, 100), "plan 4: swap 0's swap-in lands at 100, misaligned"),
        (_item("swap_in_offsets", 0, 3584), "lands at 3584, misaligned or past the plan's"),
        (_item("offsets", 2, 2048), r"plan 4: slot 2 \(2048 bytes at offset 2048\)"),
    ],
)
def test_the_client_refuses_a_plan_it_cannot_run_whole(change: Change, message: str) -> None:
    """A schedule that does not hold together is not dropped to keep the placement: the
    plan is refused as a whole, and the session goes on without it."""
    update = planupdate.write(ARENA)
    change(update)
    with pytest.raises(PlanRejected, match=message):
        decode(update)
