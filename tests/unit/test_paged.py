"""Virtual residency in the planner: the layout of a session's range, the paged iteration the
scheduler sees, and the independent count of mapped pages that makes a plan feasible."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from tidalcore.units import Tick
from tidaloffline.simulate_command import load
from tidalplan import paged, policies, wire
from tidalplan.learn import live_bytes
from tidalplan.model import Iteration, Swap, SwapPlan
from tidalplan.profile import host_peak
from tidalplan.simulate import simulate
from tidalplan.validate import InvalidSwapPlan

from .iterations import paged_pair

PAGE = 1024
ROOT = Path(__file__).resolve().parents[2]

SMALL = paged_pair()  # its blocks and ticks: tests/unit/iterations.py


def mapped_by_ticks(it: Iteration) -> list[int]:
    """Device bytes per tick of an iteration as the simulator counts them (no swaps)."""
    return [int(x) + sum(s for _, s in it.persistent) for x in live_bytes(it)]


def test_page_owning_blocks_get_whole_pages_and_the_rest_is_packed_after_them() -> None:
    lay = paged.layout(SMALL, PAGE, max_waste=0.05)
    assert lay.owning == (True, False, True)  # A, B, C in allocation order
    assert lay.persistent_owning == (True, False)  # W, V
    assert lay.persistent_addresses[0] == 0  # W: pages 0-3
    # A and C never live together: both at the first page after W.
    assert lay.addresses[0] == lay.addresses[2] == 4 * PAGE
    assert lay.packed_start == 7 * PAGE  # C's three pages end the page-owning part
    assert lay.persistent_addresses[1] == 7 * PAGE  # V, then B after V's aligned bytes
    assert lay.addresses[1] == 7 * PAGE + 256
    assert lay.length == 9 * PAGE  # B reaches into page 8


def test_a_block_whose_rounding_wastes_too_much_is_packed() -> None:
    assert paged.owns_pages(3000, PAGE, 0.05)  # 72 bytes of 3000
    assert not paged.owns_pages(2100, PAGE, 0.05)  # 972 bytes of 2100
    assert paged.owns_pages(2100, PAGE, 0.5)
    assert not paged.owns_pages(1000, PAGE, 1.0)  # under a page: never
    lay = paged.layout(SMALL, PAGE, max_waste=0.01)
    assert lay.owning == (True, False, False)


def test_the_paged_iteration_counts_exactly_the_mapped_pages() -> None:
    lay = paged.layout(SMALL, PAGE, max_waste=0.05)
    pit = paged.paged(SMALL, lay)
    assert [b.size for b in pit.blocks[:3]] == [2048, 0, 3072]
    assert pit.persistent == ((1, 4096), (2, 0))
    assert {a.block for a in pit.accesses} == {1, 3, 5}  # W, A, C: B and V never move
    # The packed pages: page 7 (V's, and B's start) all along, page 8 while B is live.
    assert [(b.size, b.start, b.end) for b in pit.blocks[3:]] == [(1024, 1, 7), (1024, 0, 10)]
    counted = paged.validate_pages(
        SMALL, lay, SwapPlan(), simulate(pit, SwapPlan(), None, 1.0, 1.0), None
    )
    assert counted == max(mapped_by_ticks(pit)) == 4096 + 3072 + 2 * 1024  # W, C, both packed


def test_a_swapped_out_block_unmaps_its_pages() -> None:
    lay = paged.layout(SMALL, PAGE, max_waste=0.05)
    pit = paged.paged(SMALL, lay)
    # W leaves after f1 (t2) and is back for f3 (t8): 4 pages free while C is live.
    away = SwapPlan((Swap(block=0, out_after=Tick(2), in_before=Tick(8), persistent=True),))
    limit = 4096 + 3072 + 1024  # W back beside C once B's packed page is unmapped
    assert simulate(pit, SwapPlan(), limit, 1.0, 1.0).feasible is False
    result = simulate(pit, away, limit, 100.0, 100.0)
    assert result.feasible
    peak = paged.validate_pages(SMALL, lay, away, result, limit)
    assert peak == limit
    with pytest.raises(InvalidSwapPlan, match="bytes mapped > the limit"):
        paged.validate_pages(SMALL, lay, away, result, peak - PAGE)


def test_two_resident_blocks_on_one_page_are_refused() -> None:
    lay = paged.layout(SMALL, PAGE, max_waste=0.05)
    pit = paged.paged(SMALL, lay)
    result = simulate(pit, SwapPlan(), None, 1.0, 1.0)
    # C over W's pages while W is resident
    bad = dataclasses.replace(lay, addresses=(lay.addresses[0], lay.addresses[1], 0))
    with pytest.raises(InvalidSwapPlan, match="both resident on page 0"):
        paged.validate_pages(SMALL, bad, SwapPlan(), result, None)
    unaligned = dataclasses.replace(lay, addresses=(lay.addresses[0] + 256, *lay.addresses[1:]))
    with pytest.raises(InvalidSwapPlan, match="not where it may lie"):
        paged.validate_pages(SMALL, unaligned, SwapPlan(), result, None)


def test_the_profile_blocks_reproduce_any_page_count() -> None:
    rng = np.random.default_rng(7)
    for _ in range(50):
        counts = [int(c) for c in rng.integers(0, 6, size=int(rng.integers(1, 30)))]
        blocks = paged._profile_blocks(counts, PAGE, 100)
        level = [0] * len(counts)
        for b in blocks:
            for t in range(b.start, b.end):
                level[t] += b.size // PAGE
        assert level == counts
        assert len({b.id for b in blocks}) == len(blocks)


@pytest.mark.parametrize("name", ["resnet18.b8", "gpt2.b4.s128"])
def test_on_a_recorded_trace_the_paged_count_and_the_addresses_agree(name: str) -> None:
    it = load(ROOT / "traces" / f"{name}.trace.csv")
    for waste in paged.WASTES:
        lay = paged.layout(it, 64 << 10, waste)
        pit = paged.paged(it, lay)
        result = simulate(pit, SwapPlan(), None, 12.0, 12.0)
        assert paged.validate_pages(it, lay, SwapPlan(), result, None) == max(mapped_by_ticks(pit))


def daemon_policy(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    return wire.on_ops(it, policies.swaps_only(it, limit, out_gbps, in_gbps))


@pytest.mark.parametrize("fraction", [0.9, 0.7, 0.5])
def test_a_plan_fits_its_limit_in_mapped_pages_as_it_is_made(fraction: float) -> None:
    it = load(ROOT / "traces" / "resnet18.b8.trace.csv")
    peak = max(mapped_by_ticks(it))
    limit = int(peak * fraction)
    made = paged.plan(it, daemon_policy, limit, 12.0, 12.0, page=64 << 10)
    assert made.fits
    assert made.mapped_peak is not None and made.mapped_peak <= limit
    assert made.result.feasible and made.schedule.swaps
    # What the simulator counted is what the addresses map.
    pit = paged.paged(it, made.layout)
    assert made.result.peak_bytes == made.mapped_peak
    assert max(mapped_by_ticks(pit)) > limit  # without its swaps it would not fit


def test_persistent_blocks_placed_by_the_online_rule_leave_room_for_a_plan_at_2_mib() -> None:
    """A session places its persistent blocks while learning, by `MAX_WASTE`, and the plan must
    live with that. GPT-2's 9 MiB weights and Adam states (4.5 pages of 2 MiB: 11% rounding)
    own their pages under it, so they can leave the device: at 0.9 of the peak, where the
    persistent bytes are 64% of the limit, the daemon's plan fits. Under a 5% rule only the
    three embeddings owned pages and no plan fit (found live, on sim: replay --page 2MiB)."""
    it = load(ROOT / "traces" / "gpt2.b4.s128.trace.csv")
    page = 2 << 20
    online = paged.layout(it, page, paged.MAX_WASTE)
    at = list(zip(online.persistent_addresses, online.persistent_owning, strict=True))
    assert sum(online.persistent_owning) == 75
    limit = int(max(mapped_by_ticks(it)) * 0.9)
    made = paged.plan(it, wire.session_schedule, limit, 12.0, 12.0, page=page, persistent_at=at)
    assert made.fits and made.mapped_peak is not None and made.mapped_peak <= limit
    assert any(s.persistent for s in made.schedule.swaps)  # weights leave and come back


def test_no_limit_means_no_schedule() -> None:
    made = paged.plan(SMALL, daemon_policy, 0, 1.0, 1.0, page=PAGE)
    assert made.fits and made.schedule == SwapPlan()
    assert made.mapped_peak == 4096 + 3072 + 2 * 1024


def test_a_page_that_is_not_whole_alignments_is_refused() -> None:
    with pytest.raises(ValueError, match="page of 1000 bytes"):
        paged.layout(SMALL, 1000)
    with pytest.raises(ValueError, match="at least one max_waste"):
        paged.plan(SMALL, daemon_policy, 8192, 1.0, 1.0, page=PAGE, wastes=())


def test_persistent_blocks_a_session_placed_keep_their_addresses() -> None:
    # W owns pages 2-5 and V is packed at 256 bytes into page 0, where the session put them.
    at = [(2 * PAGE, True), (256, False)]
    lay = paged.layout(SMALL, PAGE, max_waste=0.05, persistent_at=at)
    assert lay.persistent_addresses == (2 * PAGE, 256)
    assert lay.persistent_owning == (True, False)
    assert lay.region_start == 6 * PAGE  # past W's last page
    assert lay.addresses[0] == lay.addresses[2] == 6 * PAGE  # A and C, page-owning
    assert lay.addresses[1] >= lay.packed_start == 9 * PAGE  # B in the transients' packed part
    pit = paged.paged(SMALL, lay)
    # V's page 0 all along, plus B's pages while B is live: counted from the addresses.
    no_swaps = simulate(pit, SwapPlan(), None, 1.0, 1.0)
    peak = paged.validate_pages(SMALL, lay, SwapPlan(), no_swaps, None)
    assert peak == max(mapped_by_ticks(pit))


def test_persistent_addresses_that_cannot_be_are_refused() -> None:
    with pytest.raises(ValueError, match="persistent block 1"):  # W owning off a page
        paged.layout(SMALL, PAGE, persistent_at=[(100, True), (0, False)])
    with pytest.raises(ValueError, match="2 persistent blocks"):
        paged.layout(SMALL, PAGE, persistent_at=[(0, True)])


def test_a_block_allocated_again_before_its_last_instance_is_freed_is_refused_by_name() -> None:
    # x = session.tensor(...) in a loop: the old x goes only once the name takes the new one,
    # so block A's instances overlap for a tick and no one address can hold both.
    a = SMALL.blocks[0]
    late = dataclasses.replace(a, end=Tick(SMALL.ticks + a.start + 1), crosses=True)
    it = dataclasses.replace(SMALL, blocks=(late, *SMALL.blocks[1:]))
    with pytest.raises(ValueError, match=f"block {a.id} is allocated again"):
        paged.layout(it, PAGE)
    # Freed as it is allocated again: one instance at a time, laid out as any block.
    ok = dataclasses.replace(
        SMALL,
        blocks=(dataclasses.replace(late, end=Tick(SMALL.ticks + a.start)), *SMALL.blocks[1:]),
    )
    assert paged.plan(ok, daemon_policy, 0, 1.0, 1.0, page=PAGE).fits


def test_the_host_lease_a_plan_needs_counts_each_swap_from_its_out_to_its_in() -> None:
    lay = paged.layout(SMALL, PAGE, max_waste=0.05)
    # W (4 pages) away from t2 to t8; A (2 pages, live from t0 to t4) away from t2 to t4 too.
    w = Swap(block=0, out_after=Tick(2), in_before=Tick(8), persistent=True)
    a = Swap(block=0, out_after=Tick(2), in_before=Tick(4))
    assert host_peak(SMALL, SwapPlan((w,)), lay.page) == 4 * PAGE
    assert host_peak(SMALL, SwapPlan((w, a)), lay.page) == 6 * PAGE
    # Across the boundary: from t8 to the end, and from the start to t2, one at a time.
    crossing = Swap(block=0, out_after=Tick(8), in_before=Tick(2), persistent=True)
    assert host_peak(SMALL, SwapPlan((crossing, a)), lay.page) == 4 * PAGE
    assert host_peak(SMALL, SwapPlan(), lay.page) == 0
    # Each block rounded to the unit its host bytes are held in: a page, or an alignment.
    size = SMALL.blocks[0].size
    assert host_peak(SMALL, SwapPlan((a,)), 256) == -(-size // 256) * 256
    assert host_peak(SMALL, SwapPlan((a,)), 4 * size) == 4 * size


def test_no_layout_starts_past_the_budget() -> None:
    """With no time left after the first layout (budget_s=0), the plan is the first layout's;
    with time, the layouts of every waste are tried and the fastest feasible kept."""
    it = load(ROOT / "traces" / "resnet18.b8.trace.csv")
    limit = int(max(mapped_by_ticks(it)) * 0.7)
    hurried = paged.plan(it, daemon_policy, limit, 12.0, 12.0, page=64 << 10, budget_s=0)
    first = paged.layout(it, 64 << 10, paged.WASTES[0])
    assert hurried.layout.owning == first.owning
    full = paged.plan(it, daemon_policy, limit, 12.0, 12.0, page=64 << 10)
    assert full.fits and full.result.iteration_ns <= hurried.result.iteration_ns
