"""Planned allocation: plan hits at exact offsets, misses on any divergence, never an overlap."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from tidalclient.executors.base import Block
from tidalclient.executors.python import PythonExecutor
from tidalclient.plans import Plan, PlanRejected, PlanTable
from tidalcore.units import align_up

from .plan_scripts import SCRIPT, SLOTS, plans_of


def table(sizes: list[int], offsets: list[int], height: int, plan_id: int = 1) -> PlanTable:
    return PlanTable.build(plan_id, sizes, offsets, height, alignment=256)


def test_overlaps_are_exact() -> None:
    #  slot 0: [0, 512)  slot 1: [512, 768)  slot 2: [0, 256)  slot 3: [256, 768)
    t = table([512, 256, 256, 500], [0, 512, 0, 256], 768)
    assert t.overlaps == ((2, 3), (3,), (0,), (0, 1))


@pytest.mark.parametrize(
    ("sizes", "offsets", "height", "message"),
    [
        ([256], [0, 256], 512, "1 sizes but 2 offsets"),
        ([256], [128], 512, "slot 0 (256 bytes at offset 128)"),
        ([300], [256], 512, "slot 0 (300 bytes at offset 256)"),
        ([0], [0], 512, "slot 0 (0 bytes at offset 0)"),
    ],
)
def test_bad_plans_are_rejected(
    sizes: list[int], offsets: list[int], height: int, message: str
) -> None:
    with pytest.raises(PlanRejected, match=message.replace("(", r"\(").replace(")", r"\)")):
        table(sizes, offsets, height)


def planned_executor() -> tuple[PythonExecutor, Block]:
    """A 4 KiB lease with a persistent 256-byte block at 0 and a 3-slot plan installed."""
    ex = PythonExecutor(4096)
    weights = ex.malloc(256)
    # slot 0 and slot 2 share bytes [0, 512): slot 0 must be freed before slot 2 is allocated
    ex.install_plan(Plan(table([512, 256, 512], [0, 512, 0], 768)))
    assert ex.mode == "learning"
    ex.step()
    assert ex.mode == "planned"
    return ex, weights


def test_plan_hits_take_the_planned_offsets_in_the_arena() -> None:
    ex, _ = planned_executor()
    a = ex.malloc(512)
    b = ex.malloc(256)
    ex.free(a)
    c = ex.malloc(512)
    assert [a.offset, b.offset, c.offset] == [256, 256 + 512, 256]  # arena based at 256
    assert (ex.plan_hits, ex.plan_misses) == (3, 0)
    ex.free(b)
    ex.free(c)
    ex.step()  # the same again: the same offsets
    again = [ex.malloc(512).offset, ex.malloc(256).offset]
    assert again == [256, 768]
    assert ex.last_footprint == 256 + 768


def test_a_block_freed_late_is_a_miss_placed_outside_the_arena() -> None:
    ex, _ = planned_executor()
    a = ex.malloc(512)
    ex.malloc(256)
    late = ex.malloc(512)  # slot 2 shares slot 0's bytes, and a is still live
    assert late.offset == 256 + 768  # online, above the arena
    assert (ex.plan_hits, ex.plan_misses) == (2, 1)
    ex.free(a)


def test_size_and_order_divergence_are_misses() -> None:
    ex, _ = planned_executor()
    odd = ex.malloc(300)  # slot 0 is 512 bytes
    assert odd.offset == 256 + 768
    assert ex.malloc(256).offset == 768  # slot 1 still matches
    assert ex.malloc(1024).offset == 256 + 768 + 512  # past the plan's end: online
    assert (ex.plan_hits, ex.plan_misses) == (1, 2)


def test_too_many_misses_return_to_learning_and_the_arena_drains() -> None:
    ex, _ = planned_executor()
    ex.max_iteration_misses = 1
    kept = ex.malloc(512)  # a hit, still live when the plan is abandoned
    misses = [ex.malloc(100), ex.malloc(100)]  # two misses
    ex.step()
    assert ex.mode == "learning"
    assert ex.plan_fallbacks == 1
    for block in misses:
        ex.free(block)
    ex.free(kept)  # the last planned block: the arena's 768 bytes go back to best-fit
    assert ex.malloc(768).offset == 256


def test_a_plan_waits_for_room_for_its_arena() -> None:
    ex = PythonExecutor(1024)
    filler = ex.malloc(768)
    ex.install_plan(Plan(table([512], [0], 512)))
    ex.step()
    assert ex.mode == "learning"  # 512 bytes of arena do not fit yet
    ex.free(filler)
    ex.step()
    assert ex.mode == "planned"
    assert ex.malloc(512).offset == 0


def test_a_new_plan_replaces_the_old_once_its_slots_are_free() -> None:
    ex, _ = planned_executor()
    a = ex.malloc(512)
    ex.install_plan(Plan(table([256], [0], 256, plan_id=2)))
    ex.step()  # a still holds slot 0 of plan 1: plan 1 stays
    assert ex.malloc(512).offset == 256 + 768  # and slot 0 is a miss while a lives
    ex.free(a)
    ex.step()  # no block holds a slot of plan 1 now: plan 2 takes over
    assert ex.malloc(256).offset == 256  # plan 2's arena took plan 1's place
    assert (ex.plan_hits, ex.plan_misses) == (2, 1)


@settings(max_examples=300, deadline=None)
@given(slots=SLOTS, script=SCRIPT)
def test_no_divergence_from_the_plan_ever_yields_overlapping_bytes(
    slots: list[tuple[int, int]], script: list[tuple[str, int]]
) -> None:
    """Arbitrary plans (slots may even overlap in time: the plan is not trusted) and arbitrary
    mallocs and frees: live blocks never share a byte and stay inside the lease."""
    plan, replan = plans_of(slots)
    sizes = plan.sizes
    ex = PythonExecutor(16 * 1024)
    ex.install_plan(Plan(plan))
    live: list[Block] = []
    cursor = 0
    for action, arg in script:
        try:
            if action == "plan_size":
                live.append(ex.malloc(sizes[(cursor + arg % 2) % len(sizes)]))
                cursor += 1
            elif action == "size":
                live.append(ex.malloc(arg))
            elif action == "free" and live:
                ex.free(live.pop(arg % len(live)))
            elif action == "step":
                ex.step()
                cursor = 0
            elif action == "replan":
                ex.install_plan(Plan(replan))
        except MemoryError:
            pass
        ranges = sorted((b.offset, b.offset + align_up(b.size, 256)) for b in live)
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start, f"overlap in {ranges}"
        assert all(s >= 0 and e <= 16 * 1024 for s, e in ranges)
