"""tidalplan.wire: a plan as the PlanUpdate a session runs (exact columns), back on the
iteration's ticks, and `check`, which takes the whole update apart again and refuses one whose
offsets or schedule were changed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from tidalcore.units import ALIGNMENT, Bytes, Offset, Tick, align_up
from tidalcore.v1 import pool_pb2
from tidalplan import wire
from tidalplan.combined import Plan, fit, unlimited
from tidalplan.learn import to_problem
from tidalplan.model import Access, Iteration, Placement, Recompute, Swap, SwapPlan
from tidalplan.validate import InvalidPlacement, validate

from .iterations import build


def net() -> Iteration:
    """W persistent (2000 B), read by f1 and f4; G (500 B) written by f5 and freed in the next
    iteration after f1 reads it: it crosses the boundary.

    t0 a X   t1 f1 W G >X   t2 f G (the previous G)   t3 a Y   t4 f2 3000 X >Y   t5 f X
    t6 a Z   t7 f3 >Z   t8 f Z   t9 f4 W   t10 a G   t11 f5 Y >G   t12 f Y
    """
    it = build(
        [
            "a X 1000",
            "o f1 1000 W >X",
            "f G",
            "a Y 1000",
            "o f2 3000 X >Y",
            "f X",
            "a Z 2000",
            "o f3 1000 >Z",
            "f Z",
            "o f4 1000 W",
            "a G 500",
            "o f5 1000 Y >G",
            "f Y",
        ],
        {"W": 2000},
    )
    g = it.blocks[3]
    read = Access(Tick(1), g.id, write=False)
    return replace(
        it,
        blocks=(*it.blocks[:3], replace(g, end=Tick(it.ticks + 2), crosses=True)),
        accesses=tuple(sorted((*it.accesses, read), key=lambda a: a.tick)),
    )


NET = net()  # allocations 0 X, 1 Y, 2 Z, 3 G; ops f1..f5 are op indices 0..4
Y_AWAY = Swap(block=1, out_after=Tick(4), in_before=Tick(11))  # issued at f4 (the op before)
W_AWAY = Swap(block=0, out_after=Tick(1), in_before=Tick(9), in_at=Tick(9), persistent=True)
W_ACROSS = Swap(block=0, out_after=Tick(9), in_before=Tick(1), persistent=True)
SCHEDULES = {
    "transient and persistent swaps": SwapPlan((Y_AWAY, W_AWAY)),
    "a persistent swap across the boundary": SwapPlan((W_ACROSS, Y_AWAY)),
    "no swaps": SwapPlan(),
}


def planned(schedule: SwapPlan, limit: int = 6000, it: Iteration = NET) -> Plan:
    """The plan of a fixed schedule (on ops), placed; it fits `limit` at the first round."""
    on_ops = wire.on_ops(it, schedule)
    plan = fit(it, lambda *_: on_ops, limit, 1.0, 1.0)
    assert plan.fits and plan.rounds == 1
    return plan


def columns(update: pool_pb2.PlanUpdate) -> list[tuple[int, bool, int, int, int, int]]:
    return list(
        zip(
            update.swap_blocks,
            update.swap_persistent,
            update.swap_out_after,
            update.swap_in_at,
            update.swap_in_before,
            update.swap_in_offsets,
            strict=True,
        )
    )


def test_swap_ins_are_issued_when_an_op_begins() -> None:
    got = wire.on_ops(
        NET,
        SwapPlan(
            (
                Y_AWAY,  # default: the op before in_before, f4
                replace(Y_AWAY, in_at=Tick(6)),  # between f2 and f3: at f3
                Swap(block=1, out_after=Tick(4), in_before=Tick(7)),  # f2, f3: not before f3
                W_ACROSS,  # across the boundary, for f1: at f1, op 0
            )
        ),
    )
    assert [s.in_at for s in got.swaps] == [9, 7, 7, 1]
    assert wire.on_ops(NET, got) == got


def test_encode_writes_every_column_exactly() -> None:
    plan = planned(SCHEDULES["transient and persistent swaps"])
    update = wire.encode(NET, plan, 1.0)
    assert update.version == wire.VERSION == 2
    assert list(update.sizes) == [1000, 1000, 2000, 500]
    # X at 2048; Y's first piece at 3072, back into X's bytes at 2048; Z at 0, where W (trace
    # id 1) comes back to, and stays across the boundary; G where Y's first piece was.
    assert list(update.offsets) == [2048, 3072, 0, 3072]
    assert columns(update) == [(1, False, 1, 3, 4, 2048), (1, True, 0, 3, 3, 0)]
    assert (update.height_bytes, update.limit_bytes, update.resident_persistent_bytes) == (
        4096,
        6000,
        0,
    )
    assert list(update.recompute_blocks) == []
    assert plan.combined is not None
    starts = {b.id: b.start for b in plan.combined.pieces.blocks}
    assert list(update.swap_in_ticks) == [starts[k] for k in plan.combined.in_pieces]
    # The last tick before each copy started: W's is issued at f4 (tick 9) and starts there,
    # after tick 8 (a free) had happened.
    assert list(update.swap_in_ticks) == [9, 8]
    p = update.prediction
    assert (p.step_ns, p.baseline_ns, p.stall_ns) == (9000, 7000, 2000)  # f4 waits for W
    assert (p.out_bytes, p.in_bytes, p.peak_bytes) == (3000, 3000, 4000)
    assert (p.footprint_bytes, p.copy_gbps) == (4096, 1.0)
    assert update.plan_id == 0  # the daemon numbers its plans


@pytest.mark.parametrize("name", SCHEDULES)
def test_check_takes_apart_what_encode_wrote(name: str) -> None:
    plan = planned(SCHEDULES[name])
    assert plan.combined is not None
    update = wire.encode(NET, plan, 1.0)
    back = pool_pb2.PlanUpdate.FromString(update.SerializeToString())
    decoded = wire.decode(NET, back)
    assert decoded.schedule == plan.schedule
    assert (decoded.limit, decoded.copy_gbps, decoded.height) == (6000, 1.0, update.height_bytes)
    checked = wire.check(NET, back)
    assert checked.pieces == plan.combined.pieces
    assert checked.placement.offsets == plan.combined.placement.offsets
    assert checked.in_pieces == plan.combined.in_pieces
    assert checked.footprint == plan.combined.footprint
    crossing = [b for b in checked.pieces.blocks if b.crosses]
    assert {checked.origin[b.id] for b in crossing} >= {("block", 3)}  # G


def test_the_version_1_fields_alone_place_the_allocations_first_pieces() -> None:
    plan = planned(SCHEDULES["transient and persistent swaps"])
    assert plan.combined is not None
    update = wire.encode(NET, plan, 1.0)
    by_id = {b.id: b for b in plan.combined.pieces.blocks}
    first = tuple(by_id[plan.combined.first_pieces[i]] for i in range(len(NET.blocks)))
    problem, index = to_problem(replace(plan.combined.pieces, blocks=first), ALIGNMENT)
    offsets = tuple(update.offsets[i] for i in index)
    height = max(
        o + align_up(b.size, ALIGNMENT) for o, b in zip(offsets, problem.buffers, strict=True)
    )
    placement = Placement(tuple(Offset(o) for o in offsets), Bytes(height), "version 1")
    validate(problem, placement, capacity=update.height_bytes)


def test_a_plan_with_no_limit_is_version_2_with_its_prediction() -> None:
    plan = unlimited(NET, 12.0, 12.0)
    update = wire.encode(NET, plan, 12.0)
    assert (update.version, update.limit_bytes, len(update.swap_blocks)) == (2, 0, 0)
    assert update.resident_persistent_bytes == 2000  # W, outside the arena
    assert (update.prediction.step_ns, update.prediction.stall_ns) == (7000, 0)
    assert update.prediction.footprint_bytes == 2000 + update.height_bytes
    assert wire.check(NET, update).footprint == update.prediction.footprint_bytes


def test_check_refuses_offsets_that_overlap() -> None:
    update = wire.encode(NET, planned(SCHEDULES["transient and persistent swaps"]), 1.0)
    wire.check(NET, update)
    update.swap_in_offsets[0] = 0  # Y back onto W's bytes while W is back too
    with pytest.raises(
        InvalidPlacement,
        match=r"overlap.*swap 0's swap-in\) over ticks \[9, 12\).*swap 1's swap-in",
    ):
        wire.check(NET, update)


def test_check_refuses_swap_ins_started_before_their_pieces() -> None:
    update = wire.encode(NET, planned(SCHEDULES["transient and persistent swaps"]), 1.0)
    update.swap_in_ticks[0] -= 1
    with pytest.raises(ValueError, match="their pieces start at"):
        wire.check(NET, update)


def test_check_refuses_a_block_accessed_while_away() -> None:
    update = wire.encode(NET, planned(SCHEDULES["transient and persistent swaps"]), 1.0)
    update.swap_in_before[1] = 4  # W back for f5, but f4 reads it
    with pytest.raises(ValueError, match="accessed at tick 9 while swapped out"):
        wire.check(NET, update)


TAMPERED: dict[str, Callable[[pool_pb2.PlanUpdate], object]] = {
    "plan version 1, not 2": lambda u: setattr(u, "version", 1),
    "is over the limit": lambda u: setattr(u, "limit_bytes", 3999),
    "not the predicted": lambda u: setattr(u.prediction, "stall_ns", 0),
    "swap_in_at.1. = 5: the iteration has 5 ops": lambda u: u.swap_in_at.__setitem__(1, 5),
    "no persistent block": lambda u: u.swap_blocks.__setitem__(1, 7),
    "swap columns": lambda u: u.swap_in_offsets.pop(),
    "footprint": lambda u: setattr(u.prediction, "footprint_bytes", 4000),
    "past the 4000 bytes of its limit": lambda u: setattr(u, "limit_bytes", 4000),
    "signature": lambda u: setattr(u, "signature", bytes(16)),
}


@pytest.mark.parametrize("message", TAMPERED)
def test_check_refuses_an_update_that_is_not_this_plans(message: str) -> None:
    update = wire.encode(NET, planned(SCHEDULES["transient and persistent swaps"]), 1.0)
    TAMPERED[message](update)
    with pytest.raises(ValueError, match=message):
        wire.check(NET, update)


def test_check_refuses_a_plan_for_another_iteration() -> None:
    update = wire.encode(NET, planned(SCHEDULES["transient and persistent swaps"]), 1.0)
    with pytest.raises(ValueError, match="sizes"):
        wire.check(build(["a X 1000", "o 10 X", "f X"]), update)


def test_a_rebuilt_piece_has_no_offset_on_the_wire() -> None:
    # A (allocation 1) dropped after t5 and rebuilt for t9 by the op at t3 (as in
    # test_swap_policies): its piece from the rebuild on has no column.
    it = build(
        [
            "a X 10",
            "a A 100",
            "a S 5",
            "o 10 X >A >S",
            "f S",
            "o 10 A",
            "a B 100",
            "o 10 B",
            "f B",
            "o 10 A X",
            "f A",
            "f X",
        ]
    )
    plan = planned(SwapPlan(recomputes=(Recompute(1, Tick(5), Tick(9)),)), 1000, it)
    update = wire.encode(it, plan, 1.0)
    assert (list(update.recompute_blocks), list(update.recompute_drop_after)) == ([1], [1])
    assert list(update.recompute_before) == [3]
    with pytest.raises(ValueError, match=r"\(of allocation 1, rebuilt\): the plan carries no"):
        wire.check(it, update)


def test_encode_refuses_what_a_client_would_not_run_as_planned() -> None:
    plan = planned(SCHEDULES["transient and persistent swaps"])
    between = replace(plan, schedule=SwapPlan((replace(Y_AWAY, in_at=Tick(6)), W_AWAY)))
    with pytest.raises(ValueError, match="between ops"):
        wire.encode(NET, between, 1.0)
    with pytest.raises(ValueError, match="does not fit its limit 4000"):
        wire.encode(NET, replace(plan, limit=Bytes(4000)), 1.0)


def test_a_plan_refreshed_on_its_own_iteration_is_itself_and_on_other_times_passes_check() -> None:
    update = wire.encode(NET, planned(SCHEDULES["transient and persistent swaps"]), 1.0)
    assert wire.refreshed(NET, update) == update
    slower = replace(NET, ops=tuple(replace(op, duration_ns=op.duration_ns * 2) for op in NET.ops))
    fresh = wire.refreshed(slower, update)
    assert fresh.prediction.baseline_ns == 2 * update.prediction.baseline_ns
    assert fresh.offsets == update.offsets and fresh.swap_blocks == update.swap_blocks
    wire.check(slower, fresh)
    with pytest.raises(ValueError, match="not the predicted"):
        wire.check(slower, update)  # the last run's timeline is not this one's
