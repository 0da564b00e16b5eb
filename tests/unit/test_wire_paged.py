"""tidalplan.wire, version 3: a plan for a session under virtual residency as the PlanUpdate it
runs (exact columns), back on the iteration's ticks, and `check_paged`, which rebuilds the
layout from the update and the session's persistent addresses and counts the mapped pages
again, refusing an update whose addresses or limit were changed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from tidalcore.units import Bytes, Tick
from tidalcore.v1 import pool_pb2
from tidaloffline.simulate_command import load
from tidalplan import paged, wire
from tidalplan.model import Iteration, SwapPlan
from tidalplan.simulate import simulate
from tidalplan.validate import InvalidSwapPlan

from .iterations import paged_pair

PAGE = 1024
GBPS = 100.0
ROOT = Path(__file__).resolve().parents[2]

SMALL = paged_pair()  # W, V persistent; A [0, 4), B [1, 7), C [5, 9): tests/unit/iterations.py
# Where the session put W (pages 2-5, its own) and V (packed, 256 bytes into page 0): the
# plan's region starts at page 6.
AT = [(2 * PAGE, True), (256, False)]
LIMIT = 4096 + 3072 + 1024  # W's, C's and B's pages: W must leave while C is live


def small_plan(limit: int = LIMIT) -> paged.PagedPlan:
    """The plan of SMALL with A and C owning pages (`max_waste` 0.05): W away from f1 to f3."""
    made = paged.plan(
        SMALL, wire.session_schedule, limit, GBPS, GBPS, page=PAGE, wastes=(0.05,), persistent_at=AT
    )
    assert made.fits
    return made


def encoded(limit: int = LIMIT) -> pool_pb2.PlanUpdate:
    return wire.encode_paged(SMALL, small_plan(limit), GBPS)


def test_encode_paged_writes_every_column_exactly() -> None:
    update = encoded()
    assert (update.version, update.page_bytes, update.region_bytes) == (3, PAGE, 4 * PAGE)
    assert list(update.sizes) == [2048, 1000, 3000]
    # A and C own the region's first pages, in turn; B is packed on the page after C's.
    assert list(update.addresses) == [0, 3 * PAGE, 0]
    assert list(update.owning) == [True, False, True]
    # W (trace id 1) out after f1 (op 0), issued back at f2 (op 2) for f3 (op 3); its pages
    # are mapped again once B is freed (tick 7).
    assert (list(update.swap_blocks), list(update.swap_persistent)) == ([1], [True])
    assert (list(update.swap_out_after), list(update.swap_in_at)) == ([0], [2])
    assert (list(update.swap_in_before), list(update.swap_in_ticks)) == ([3], [7])
    assert (update.limit_bytes, update.mapped_peak_bytes) == (LIMIT, LIMIT)
    p = update.prediction
    assert (p.step_ns, p.baseline_ns, p.stall_ns) == (441, 400, 41)
    assert (p.out_bytes, p.in_bytes, p.peak_bytes, p.footprint_bytes) == (4096, 4096, LIMIT, LIMIT)
    assert p.copy_gbps == GBPS
    # The version-2 placement fields are not used.
    assert (list(update.offsets), update.height_bytes, list(update.swap_in_offsets)) == ([], 0, [])
    assert update.resident_persistent_bytes == 0


def test_decode_and_check_paged_give_back_the_plan_that_was_encoded() -> None:
    made = small_plan()
    update = wire.encode_paged(SMALL, made, GBPS)
    decoded = wire.decode_paged(SMALL, update)
    assert decoded == wire.DecodedPaged(
        schedule=made.schedule,
        addresses=(0, 3 * PAGE, 0),
        owning=(True, False, True),
        region_bytes=4 * PAGE,
        page=PAGE,
        limit=Bytes(LIMIT),
        copy_gbps=GBPS,
        mapped_peak=Bytes(LIMIT),
    )
    checked = wire.check_paged(SMALL, update, LIMIT, GBPS, AT)
    assert checked.layout.addresses == made.layout.addresses == (6 * PAGE, 9 * PAGE, 6 * PAGE)
    assert checked.layout.region_start == made.layout.region_start == 6 * PAGE
    assert checked.layout.length == made.layout.length == 10 * PAGE
    assert (checked.schedule, checked.result, checked.mapped_peak) == (
        made.schedule,
        made.result,
        LIMIT,
    )


def test_a_plan_with_no_limit_has_no_swaps_and_maps_its_whole_peak() -> None:
    made = wire.paged_session_plan(SMALL, 0, GBPS, PAGE, AT)
    update = wire.encode_paged(SMALL, made, GBPS)
    assert (update.limit_bytes, len(update.swap_blocks)) == (0, 0)
    # At f2: W's 4 pages, V's page 0, B's page and C's 3 (C packed: at the first `max_waste`
    # tried, 2%, its rounding to whole pages, 2.4%, is too much).
    assert list(update.owning) == [True, False, False]
    assert update.mapped_peak_bytes == 9 * PAGE
    assert wire.check_paged(SMALL, update, 0, GBPS, AT).mapped_peak == 9 * PAGE


def first_two_resident_together(it: Iteration, made: paged.PagedPlan) -> tuple[int, int]:
    """Two page-owning transient blocks of `made` live at once and never swapped (both
    resident then), the second no more pages than the first."""
    page = made.layout.page
    swapped = {s.block for s in made.schedule.swaps if not s.persistent}
    own = [
        i for i, b in enumerate(it.blocks) if made.layout.owning[i] and b.size and i not in swapped
    ]
    for i in own:
        for j in own:
            a, b = it.blocks[i], it.blocks[j]
            overlap = a.start < b.end and b.start < a.end and not (a.crosses or b.crosses)
            if i != j and overlap and -(-b.size // page) <= -(-a.size // page):
                return i, j
    raise AssertionError("no two page-owning blocks resident at once")


@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_on_a_recorded_trace_the_update_checks_and_a_block_moved_onto_another_does_not(
    fraction: float,
) -> None:
    it = load(ROOT / "traces" / "resnet18.b8.trace.csv")
    page = 64 << 10
    # The persistent blocks where a session would put them: as the layout lays them out alone.
    alone = paged.layout(it, page)
    at = list(zip(alone.persistent_addresses, alone.persistent_owning, strict=True))
    peak = simulate(paged.paged(it, alone), SwapPlan(), None, 12.0, 12.0).peak_bytes
    limit = int(peak * fraction)
    made = wire.paged_session_plan(it, limit, 12.0, page, at)
    assert made.fits and made.schedule.swaps
    update = wire.encode_paged(it, made, 12.0)
    checked = wire.check_paged(it, update, limit, 12.0, at)
    assert checked.layout.addresses == made.layout.addresses
    assert checked.mapped_peak == made.mapped_peak == update.mapped_peak_bytes
    assert update.mapped_peak_bytes <= limit
    assert len(update.addresses) == len(it.blocks) == len(update.sizes)
    i, j = first_two_resident_together(it, made)
    update.addresses[j] = update.addresses[i]
    with pytest.raises(InvalidSwapPlan, match=f"block {it.blocks[j].id} are both resident on page"):
        wire.check_paged(it, update, limit, 12.0, at)


def test_check_paged_refuses_a_packed_block_moved_onto_a_page_owning_ones_page() -> None:
    update = encoded()
    update.addresses[1] = 0  # B (live [1, 7)) onto A's first page (A live [0, 4))
    with pytest.raises(InvalidSwapPlan, match="page 6 holds a page-owning block and a packed one"):
        wire.check_paged(SMALL, update, LIMIT, GBPS, AT)


def test_check_paged_refuses_a_limit_the_mapped_pages_exceed() -> None:
    update = encoded()
    update.limit_bytes = LIMIT - PAGE  # as if made for a page less
    with pytest.raises(ValueError, match=f"mapped peak {LIMIT} is over the limit {LIMIT - PAGE}"):
        wire.check_paged(SMALL, update, LIMIT - PAGE, GBPS, AT)
    # Every number lowered with it: the schedule does not run within a page less.
    update.mapped_peak_bytes = LIMIT - PAGE
    update.prediction.peak_bytes = update.prediction.footprint_bytes = LIMIT - PAGE
    with pytest.raises(ValueError, match=r"simulates to .*infeasibly"):
        wire.check_paged(SMALL, update, LIMIT - PAGE, GBPS, AT)


def test_check_paged_refuses_a_plan_made_for_another_limit_or_bandwidth() -> None:
    update = encoded()
    with pytest.raises(ValueError, match=f"made for limit {LIMIT} at 100 GB/s, not the session's"):
        wire.check_paged(SMALL, update, LIMIT + PAGE, GBPS, AT)
    with pytest.raises(ValueError, match="not the session's 8192 at 50 GB/s"):
        wire.check_paged(SMALL, update, LIMIT, 50.0, AT)


def test_check_paged_refuses_persistent_blocks_that_cannot_lie_where_the_session_says() -> None:
    update = encoded()
    with pytest.raises(ValueError, match="persistent block 1 at 100 cannot own pages there"):
        wire.check_paged(SMALL, update, LIMIT, GBPS, [(100, True), (256, False)])
    with pytest.raises(ValueError, match="1 persistent addresses for 2 persistent blocks"):
        wire.check_paged(SMALL, update, LIMIT, GBPS, AT[:1])
    # W said to share pages: its swap cannot move it.
    with pytest.raises(ValueError, match=r"swap_blocks\[0\] = 1: the persistent block shares"):
        wire.check_paged(SMALL, update, LIMIT, GBPS, [(2 * PAGE, False), (256, False)])


Change = Callable[[pool_pb2.PlanUpdate], object]


def _set(column: str, value: object) -> Change:
    return lambda u: setattr(u, column, value)


def _item(column: str, k: int, value: object) -> Change:
    return lambda u: getattr(u, column).__setitem__(k, value)


def rebuild_a(update: pool_pb2.PlanUpdate) -> None:
    """A rebuilt from after f1 (op 0) to before f2 (op 2)."""
    update.recompute_blocks.append(0)
    update.recompute_drop_after.append(0)
    update.recompute_before.append(2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set("version", 2), "plan version 2, not 3"),
        (_item("sizes", 0, 2047), r"sizes \[2047, 1000, 3000\]\.\.\. are not the iteration's"),
        (_set("page_bytes", 0), "page_bytes 0 is not a power of two of at least 256 bytes"),
        (_set("page_bytes", 768), "page_bytes 768 is not a power of two of at least 256 bytes"),
        (lambda u: u.addresses.append(0), "4 addresses for 3 allocations"),
        (lambda u: u.owning.pop(), "2 owning for 3 allocations"),
        (_set("region_bytes", 4000), "region_bytes 4000 is not whole pages of 1024 bytes"),
        (_item("addresses", 0, 256), r"addresses\[0\] = 256: allocation 0 owns pages but lies"),
        (_item("addresses", 1, 100), r"addresses\[1\] = 100: allocation 1 shares pages but lies"),
        (
            _item("addresses", 2, 2 * PAGE),
            r"addresses\[2\] = 2048: allocation 2 ends at 5120, past the region's 4096 bytes",
        ),
        (lambda u: u.offsets.extend([0, 0, 0]), "offsets is set: version 3 places blocks by"),
        (_set("height_bytes", 4096), "height_bytes is set"),
        (lambda u: u.swap_in_ticks.append(0), r"the swap columns \(swap_in_ticks included\)"),
        (rebuild_a, "recompute_blocks is set: a paged plan only swaps blocks"),
        (_item("swap_out_after", 0, 9), r"swap_out_after\[0\] = 9: the iteration has 4 ops"),
    ],
)
def test_decode_paged_names_the_first_column_that_does_not_fit(
    change: Change, message: str
) -> None:
    update = encoded()
    change(update)
    with pytest.raises(ValueError, match=message):
        wire.decode_paged(SMALL, update)


def test_decode_paged_refuses_a_swap_of_a_block_that_shares_pages() -> None:
    update = encoded()
    update.swap_persistent[0] = False
    update.swap_blocks[0] = 1  # B: packed
    with pytest.raises(ValueError, match=r"swap_blocks\[0\] = 1: the allocation shares pages"):
        wire.decode_paged(SMALL, update)


def test_encode_paged_refuses_what_cannot_be_sent() -> None:
    unfit = paged.plan(
        SMALL, wire.session_schedule, 4096, GBPS, GBPS, page=PAGE, wastes=(0.05,), persistent_at=AT
    )
    assert not unfit.fits
    with pytest.raises(ValueError, match="does not fit its limit 4096 in mapped pages"):
        wire.encode_paged(SMALL, unfit, GBPS)
    made = small_plan()
    (swap,) = made.schedule.swaps
    at_a_free = SwapPlan((replace(swap, in_at=Tick(7)),))  # tick 7 frees B: no op begins there
    with pytest.raises(ValueError, match="issues swap-ins between ops"):
        wire.encode_paged(SMALL, replace(made, schedule=at_a_free), GBPS)


def test_a_paged_plan_refreshed_on_its_own_iteration_is_itself() -> None:
    update = encoded()
    assert wire.refreshed_paged(SMALL, update, AT) == update
    slower = replace(
        SMALL, ops=tuple(replace(op, duration_ns=op.duration_ns * 3) for op in SMALL.ops)
    )
    fresh = wire.refreshed_paged(slower, update, AT)
    assert fresh.prediction.baseline_ns == 3 * update.prediction.baseline_ns
    assert fresh.addresses == update.addresses and fresh.swap_blocks == update.swap_blocks
    assert wire.check_paged(slower, fresh, LIMIT, GBPS, AT).mapped_peak <= LIMIT
