"""The swap engine executing a whole plan: every piece at its planned offset, swap-outs after
their ops, swap-ins into their pieces, a slot's bytes reused in stream order, and the LRU cache
only as the fallback, its traffic counted apart."""

from __future__ import annotations

from tidalclient.devices.streams import Stream
from tidalclient.executors.base import HOST
from tidalclient.plans import Plan, PlanTable
from tidalcore.planupdate import ScheduledSwap

from tests.unit.test_swap_engine import Rig
from tests.unit.test_swap_engine import rigs as rigs_fixture

rigs = rigs_fixture  # the engine tests' fixture: rigs closed, their streams stopped

KiB = 1024


def plan(
    swaps: tuple[ScheduledSwap, ...], in_offsets: tuple[int, ...], limit: int = 2 * KiB
) -> Plan:
    """Allocations a, b, c of 1 KiB at 0, 1 KiB, 0 (c reuses a's bytes once a is out)."""
    table = PlanTable.build(7, [KiB] * 3, [0, KiB, 0], 2 * KiB, 256)
    return Plan(table, swaps, in_offsets, version=2, limit=limit)


A_OUT = ScheduledSwap(block=0, out_after=0, in_before=3, in_at=2)


def iteration(rig: Rig, n: int) -> dict[str, int]:
    """a written; b written; c (a's slot) written from b; b and c freed; a read back; a freed.
    Returns the offsets where a was written, c was placed and a came back."""
    ex = rig.ex
    ex.step()
    a = ex.malloc(KiB)
    seen = {"a": ex.begin_op([a])[0]}
    ex.end_op([a])
    rig.device.buffer(seen["a"], KiB)[:] = bytes([n]) * KiB  # written between the op's ends
    b = rig.filled(KiB, 100 + n)
    c = ex.malloc(KiB)
    seen["c"] = ex.begin_op([b, c])[1]
    ex.end_op([b, c])
    ex.free(b)
    ex.free(c)
    seen["a_back"] = ex.begin_op([a])[0]
    assert bytes(rig.device.buffer(seen["a_back"], KiB)) == bytes([n]) * KiB
    ex.end_op([a])
    ex.free(a)
    return seen


def switched(rigs: list[Rig], compute: Stream | None = None, limit: int = 2 * KiB) -> Rig:
    """A rig that learned one iteration and has switched to the plan swapping a out (its
    piece at 1 KiB), made for `limit`."""
    kw = {} if compute is None else {"compute": lambda: compute}
    rig = Rig(limit=limit, device=8 * KiB, host=8 * KiB, **kw)
    rigs.append(rig)
    iteration(rig, 1)
    rig.ex.install_plan(plan((A_OUT,), (KiB,), limit=limit))
    rig.ex.step()
    assert rig.ex.stats().mode == "planned"
    return rig


def test_the_session_executes_the_plan_whole_and_the_lru_moves_nothing(rigs: list[Rig]) -> None:
    rig = Rig(limit=2 * KiB, device=8 * KiB, host=8 * KiB)
    rigs.append(rig)
    iteration(rig, 1)  # learning: the LRU cache makes room for c
    learned = rig.ex.swap_stats()
    assert learned.on_demand_out_bytes == KiB and learned.planned_out_bytes == 0
    rig.ex.install_plan(plan((A_OUT,), (KiB,)))
    for n in (2, 3, 4):
        before = rig.ex.swap_stats()
        seen = iteration(rig, n)
        after = rig.ex.swap_stats()
        assert rig.ex.stats().mode == "planned"
        base = seen["a"]  # the arena's base: a sits at slot 0
        assert (seen["c"], seen["a_back"]) == (base, base + KiB)  # c on a's bytes, a at its piece
        moved = {
            f: getattr(after, f) - getattr(before, f)
            for f in ("planned_out_bytes", "planned_in_bytes", "on_demand_out_bytes")
        }
        assert moved == {
            "planned_out_bytes": KiB,
            "planned_in_bytes": KiB,
            "on_demand_out_bytes": 0,
        }
        assert after.on_demand_in_bytes == learned.on_demand_in_bytes
        assert (after.piece_misses, after.schedule_skips) == (0, 0)


def test_a_slot_reused_while_its_copy_out_runs_orders_the_compute_stream(
    rigs: list[Rig],
) -> None:
    compute = Stream("compute")
    rig = switched(rigs, compute)
    ex = rig.ex
    a = ex.malloc(KiB)
    gate = rig.gate("out")  # a's copy out, scheduled after op 0, cannot finish yet
    try:
        rig.op(a, write=bytes([9]) * KiB)
        b = rig.filled(KiB, 8)
        c = ex.malloc(KiB)  # a's slot: given at once, the host does not wait for the copy
        assert ex.inner.slot(c.id) == 2 and ex.offset(c) == ex._entries[a.id].offset
        marker = compute.record()  # compute work after c's malloc waits for a's copy
        assert not marker.wait(timeout=0.05)
    finally:
        gate.set()
    assert marker.wait(timeout=30)
    ex.free(b)
    ex.free(c)
    (where,) = ex.begin_op([a])  # its swap-in lands at its piece; compute waits for it
    compute.synchronize()
    assert bytes(rig.device.buffer(where, KiB)) == bytes([9]) * KiB
    ex.end_op([a])
    compute.close()


def test_a_swap_in_waits_for_its_piece_to_be_freed(rigs: list[Rig]) -> None:
    # a's swap-in is issued at op 2, but its piece is b's slot, free only after op 2.
    rig = switched(rigs)
    ex = rig.ex
    a = rig.filled(KiB, 5)
    b = rig.filled(KiB, 6)
    c = ex.malloc(KiB)
    ex.begin_op([b, c])
    assert ex.where(a) == HOST and 0 in ex._pending_ins  # b still holds a's piece
    ex.end_op([b, c])
    ex.free(b)  # the piece is free: a's swap-in lands there now
    assert 0 not in ex._pending_ins and ex.where(a) != HOST
    ex.free(c)
    assert rig.op(a) == [bytes([5]) * KiB]
    assert ex.swap_stats().piece_misses == 0


def test_a_piece_still_held_when_needed_comes_in_online(rigs: list[Rig]) -> None:
    rig = switched(rigs, limit=3 * KiB)
    ex = rig.ex
    a = rig.filled(KiB, 5)
    b = rig.filled(KiB, 6)
    c = ex.malloc(KiB)
    rig.op(b, c)
    ex.free(c)  # b is kept past op 3: a's piece is still b's when op 3 needs a
    assert rig.op(a) == [bytes([5]) * KiB]
    s = ex.swap_stats()
    assert s.piece_misses == 1 and s.planned_in_bytes == KiB and s.on_demand_in_bytes == 0
    arena = ex.inner._arena
    assert arena is not None
    assert not arena.base <= ex.offset(a) < arena.base + arena.table.height  # placed online


def test_a_persistent_block_moves_into_its_piece_and_stays_there(rigs: list[Rig]) -> None:
    # p (1 KiB) lives across iterations. The plan swaps it out after op 0 and back before op 2,
    # into a piece at 2 KiB of the arena, where it stays across the boundary.
    rig = Rig(limit=3 * KiB, device=8 * KiB, host=8 * KiB)
    rigs.append(rig)
    ex = rig.ex
    p = rig.filled(KiB, 42)

    def one(n: int) -> int:
        ex.step()
        x = rig.filled(KiB, n)  # op 0
        ex.free(x)
        y = ex.malloc(2 * KiB)
        rig.op(y)  # op 1
        ex.free(y)
        where = ex.begin_op([p])[0]  # op 2
        assert bytes(rig.device.buffer(where, KiB)) == bytes([42]) * KiB
        ex.end_op([p])
        return where

    one(1)
    table = PlanTable.build(3, [KiB, 2 * KiB], [0, 0], 3 * KiB, 256)
    swap = ScheduledSwap(block=p.id, out_after=0, in_before=2, in_at=1, persistent=True)
    ex.install_plan(Plan(table, (swap,), (2 * KiB,), version=2, limit=3 * KiB))
    one(2)  # the switch: p leaves its online bytes for room (on demand), lands in its piece
    assert ex.stats().mode == "planned"
    arena = ex.inner._arena
    assert arena is not None
    switched = ex.swap_stats()
    assert [one(n) for n in (3, 4)] == [arena.base + 2 * KiB] * 2
    steady = ex.swap_stats()
    assert steady.planned_out_bytes - switched.planned_out_bytes == 2 * KiB
    assert steady.planned_in_bytes - switched.planned_in_bytes == 2 * KiB
    assert (steady.on_demand_out_bytes, steady.on_demand_in_bytes) == (
        switched.on_demand_out_bytes,
        switched.on_demand_in_bytes,
    )
    assert steady.piece_misses == 0 and steady.peak_resident_bytes <= 3 * KiB + KiB


def test_an_older_plan_runs_its_schedule_with_swap_ins_placed_here(rigs: list[Rig]) -> None:
    # Version 1 (no swap-in offsets): the schedule runs, the placement made without the swaps
    # is not used under a limit.
    rig = Rig(limit=2 * KiB, device=8 * KiB, host=8 * KiB)
    rigs.append(rig)
    iteration(rig, 1)
    rig.ex.install_plan(Plan(plan((A_OUT,), ()).table, (A_OUT,)))
    iteration(rig, 2)
    s = rig.ex.swap_stats()
    assert rig.ex.stats().mode == "learning" and rig.ex.plans_deferred == 1
    assert s.scheduled_swaps == 1 and s.planned_out_bytes == KiB


def test_a_plan_made_for_a_higher_limit_is_not_executed_whole(rigs: list[Rig]) -> None:
    rig = Rig(limit=2 * KiB, device=8 * KiB, host=8 * KiB)
    rigs.append(rig)
    iteration(rig, 1)
    rig.ex.install_plan(plan((A_OUT,), (KiB,), limit=4 * KiB))
    iteration(rig, 2)
    assert rig.ex.stats().mode == "learning" and rig.ex.plans_deferred == 1


def test_a_piece_freed_while_its_swap_in_runs_is_free_at_once_in_stream_order(
    rigs: list[Rig],
) -> None:
    compute = Stream("compute")
    rig = switched(rigs, compute)
    ex = rig.ex
    a = rig.filled(KiB, 5)
    b = rig.filled(KiB, 6)
    c = ex.malloc(KiB)
    gate = rig.gate("in")
    try:
        rig.ex.begin_op([b, c])  # op 2: a's swap-in waits for b's slot
        rig.ex.end_op([b, c])
        ex.free(b)  # a's swap-in is issued into b's old slot, and held behind the gate
        ex.free(c)
        assert ex.inner.slot(a.id) == 3 and ex._entries[a.id].flight is not None
        in_event = ex._entries[a.id].flight.event
        ex.free(a)  # while its copy in runs: the piece is free now, its next holder waits
        assert ex.inner.slot(a.id) is None and ex._fences[3] is in_event
    finally:
        gate.set()
    compute.synchronize()
    ex.synchronize()
    compute.close()


def test_a_swap_in_starts_after_the_event_the_plan_says_not_at_its_issue_op(
    rigs: list[Rig],
) -> None:
    # a leaves after op 0 and is needed at op 3; its swap-in is issued at op 1, but its piece
    # (at 1 KiB) is c's slot until c is freed (event 5): it starts then, and c is a plan hit.
    rig = Rig(limit=2 * KiB, device=8 * KiB, host=8 * KiB)
    rigs.append(rig)
    ex = rig.ex

    def one(n: int) -> tuple[int, int]:
        ex.step()
        a = rig.filled(KiB, n)  # events 0 (malloc), 1 (op 0)
        rig.op()  # event 2: op 1, where a's swap-in is issued
        c = ex.malloc(KiB)  # event 3
        rig.op(c, write=bytes([7]) * KiB)  # event 4: op 2
        where_c = ex.offset(c)
        ex.free(c)  # event 5: a's swap-in starts after it
        (seen,) = rig.op(a)  # event 6: op 3
        assert seen == bytes([n]) * KiB
        where_a = ex.offset(a)
        ex.free(a)
        return where_c, where_a

    one(1)
    table = PlanTable.build(5, [KiB, KiB], [0, KiB], 2 * KiB, 256)
    swap = ScheduledSwap(block=0, out_after=0, in_before=3, in_at=1)
    ex.install_plan(Plan(table, (swap,), (KiB,), (5,), version=2, limit=2 * KiB))
    one(2)
    misses = ex.stats().plan_misses
    base = ex.inner._arena.base if ex.inner._arena is not None else -1
    assert one(3) == (base + KiB, base + KiB)  # c on its slot, then a on the same bytes
    assert ex.stats().plan_misses == misses and ex.swap_stats().piece_misses == 0


def test_a_plan_whose_arena_finds_no_range_engages_at_any_limit(rigs: list[Rig]) -> None:
    """Blocks placed while learning leave no range long enough for the plan's arena: those
    that can leave do, at the switch, whether the swap limit is under the lease or not, and
    their bytes come back intact. A plan made for a limit over the lease is made for the
    lease, as the session's limit is."""
    for limit in (3 * KiB, 4 * KiB, 1 << 20):  # under, at and over the lease
        rig = Rig(limit=limit, device=4 * KiB, host=8 * KiB)
        rigs.append(rig)
        x, gap, y = rig.filled(KiB, 1), rig.ex.malloc(KiB), rig.filled(KiB, 2)
        rig.ex.free(gap)  # free: [KiB, 2 KiB) and [3 KiB, 4 KiB), none 2 KiB long
        table = PlanTable.build(3, [2 * KiB], [0], 2 * KiB, 256)
        rig.ex.install_plan(Plan(table, version=2, limit=limit))
        rig.ex.step()
        assert rig.ex.stats().mode == "planned", limit
        assert HOST in rig.where(x, y)  # what left made the room
        assert rig.op(x) == [bytes([1]) * KiB] and rig.op(y) == [bytes([2]) * KiB]
