"""planner/simulate and validate: recomputation. A dropped block leaves at once, its writers
run again before the op that needs it, on the compute stream, with their inputs on the device;
the validator checks the same from the timeline alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tidalcore.units import Tick
from tidalplan.model import Recompute, Swap, SwapPlan
from tidalplan.simulate import no_limit, simulate
from tidalplan.validate import InvalidSwapPlan, validate_swaps

from .iterations import TWO_LAYERS, build

STEPS = TWO_LAYERS
NET = build(STEPS, persistent={"W": 100})
A, B = 1, 2
DROP_A = Recompute(block=A, drop_after=Tick(4), before=Tick(12))


def test_without_recomputation_the_peak_does_not_fit() -> None:
    base = no_limit(NET)
    assert base.baseline_ns == 6100 and base.peak_bytes == 13_110
    assert not simulate(NET, SwapPlan(), 13_100, 12.0, 12.0).feasible


def test_a_dropped_block_is_gone_until_its_writer_runs_again() -> None:
    plan = SwapPlan(recomputes=(DROP_A,))
    r = simulate(NET, plan, 13_100, 12.0, 12.0)
    assert r.feasible
    assert r.iteration_ns == 6100 + 1000  # fwd1 once more, nothing else waits
    assert (r.recompute_ns, r.recomputed_bytes, r.out_bytes, r.stall_ns) == (1000, 4000, 0, 0)
    assert r.peak_bytes == 13_100  # at op 12, A back beside X, GB, GA and W
    # The rebuild starts when bwd2 ends (3100 + 2000 ns) and bwd1 follows it.
    assert r.rebuild_ns == (5100,)
    assert r.tick_ns[12] == 6100
    assert max(d for t, d in r.curve if t < 5100) == 9110  # A gone over the old peak
    validate_swaps(NET, plan, r, 13_100, 12.0)


def test_compute_scale_scales_the_rebuild() -> None:
    r = simulate(NET, SwapPlan(recomputes=(DROP_A,)), None, 12.0, 12.0, compute_scale=2.0)
    assert (r.iteration_ns, r.recompute_ns) == (14_200, 2000)
    validate_swaps(NET, SwapPlan(recomputes=(DROP_A,)), r, None, 12.0, compute_scale=2.0)
    with pytest.raises(InvalidSwapPlan, match="does not fit between"):
        validate_swaps(NET, SwapPlan(recomputes=(DROP_A,)), r, None, 12.0, compute_scale=3.0)


def test_blocks_rebuilt_for_one_op_are_one_rebuild_in_tick_order() -> None:
    # B's writer reads A: with A rebuilt for the same op, both writers run once each.
    plan = SwapPlan(
        recomputes=(
            Recompute(block=B, drop_after=Tick(6), before=Tick(8)),
            Recompute(block=A, drop_after=Tick(4), before=Tick(8)),
        )
    )
    r = simulate(NET, plan, None, 12.0, 12.0)
    assert (r.recompute_ns, r.recomputed_bytes) == (3000, 8000)
    assert r.rebuild_ns[0] == r.rebuild_ns[1]
    validate_swaps(NET, plan, r, None, 12.0)


def test_a_writer_whose_input_is_away_cannot_run_again() -> None:
    # B is rebuilt for op 8 by fwd2, which reads A; A is dropped until op 12.
    plan = SwapPlan(recomputes=(DROP_A, Recompute(block=B, drop_after=Tick(6), before=Tick(8))))
    with pytest.raises(ValueError, match="op 4 reads block 3, which is not on the device"):
        simulate(NET, plan, None, 12.0, 12.0)
    # Swapped out over op 8 is away just the same.
    swap_a = Swap(block=A, out_after=Tick(4), in_before=Tick(12))
    plan = SwapPlan((swap_a,), (Recompute(block=B, drop_after=Tick(6), before=Tick(8)),))
    with pytest.raises(ValueError, match="not on the device"):
        simulate(NET, plan, None, 12.0, 12.0)


@pytest.mark.parametrize(
    ("recompute", "message"),
    [
        (Recompute(block=A, drop_after=Tick(2), before=Tick(12)), "accessed while dropped"),
        (Recompute(block=A, drop_after=Tick(4), before=Tick(13)), "must be op ticks"),
        (Recompute(block=9, drop_after=Tick(4), before=Tick(12)), "no such block"),
        (Recompute(block=A, drop_after=Tick(12), before=Tick(4)), "not start < drop_after"),
    ],
)
def test_malformed_recomputations_are_refused(recompute: Recompute, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(NET, SwapPlan(recomputes=(recompute,)), None, 12.0, 12.0)


def test_a_block_swapped_and_dropped_over_one_interval_is_refused() -> None:
    plan = SwapPlan((Swap(block=A, out_after=Tick(4), in_before=Tick(12)),), (DROP_A,))
    with pytest.raises(ValueError, match="overlaps"):
        simulate(NET, plan, None, 12.0, 12.0)


def test_a_rebuild_waits_for_room_like_a_malloc() -> None:
    # V, a weight only the loss reads, leaves after it: its slow copy (2500 ns at 0.2 GB/s,
    # from 3100 ns) makes the room A's rebuild needs at 5600 ns, 500 ns after bwd2 ended.
    steps = [*STEPS]
    steps[6] = "o loss 100 B V >L"
    it = build(steps, persistent={"W": 100, "V": 500})
    swap_v = Swap(block=1, out_after=Tick(6), in_before=Tick(6), in_at=Tick(0), persistent=True)
    plan = SwapPlan((swap_v,), (DROP_A,))
    r = simulate(it, plan, 13_100, 0.2, 0.2)
    assert r.feasible and r.rebuild_ns == (5600,) and r.stall_ns == 500
    assert r.iteration_ns == 6100 + 500 + 1000
    validate_swaps(it, plan, r, 13_100, 0.2)
    # Without room the rebuild never fits.
    assert not simulate(NET, SwapPlan(recomputes=(DROP_A,)), 13_099, 1.0, 1.0).feasible


def test_scratch_for_the_other_outputs_of_a_rebuilt_op() -> None:
    # fwd1 also writes S (freed at once): running it again needs S's bytes as scratch.
    steps = [*STEPS]
    steps[2] = "o fwd1 1000 X W >A >S"
    steps.insert(2, "a S 500")  # tick 2; every later tick moves up by one
    steps.insert(4, "f S")  # tick 4
    it = build(steps, persistent={"W": 100})
    plan = SwapPlan(recomputes=(Recompute(block=A, drop_after=Tick(6), before=Tick(14)),))
    r = simulate(it, plan, None, 12.0, 12.0)
    assert r.peak_bytes == 13_600  # at the rebuild: X GB GA A W and S's scratch
    validate_swaps(it, plan, r, 13_600, 12.0)
    with pytest.raises(InvalidSwapPlan, match="13600 device bytes > 13599"):
        validate_swaps(it, plan, r, 13_599, 12.0)
    assert not simulate(it, plan, 13_599, 12.0, 12.0).feasible


def test_the_validator_checks_recomputation_from_the_trace_itself() -> None:
    plan = SwapPlan(recomputes=(DROP_A,))
    r = simulate(NET, plan, 13_100, 12.0, 12.0)
    # The same timeline on a trace where fwd2 also writes X, which fwd1 reads: running fwd1
    # again in backward would read the wrong X.
    steps = [*STEPS]
    steps[4] = "o fwd2 2000 A >B >X"
    with pytest.raises(
        InvalidSwapPlan, match="op 2, run again for op 12, reads block 2, which is written again"
    ):
        validate_swaps(build(steps, persistent={"W": 100}), plan, r, 13_100, 12.0)
    # A rebuild that starts before the op before it has ended, or overlaps the op it serves.
    with pytest.raises(InvalidSwapPlan, match="does not fit"):
        validate_swaps(NET, plan, replace(r, rebuild_ns=(5000,)), 13_100, 12.0)
    with pytest.raises(InvalidSwapPlan, match="does not fit"):
        validate_swaps(NET, plan, replace(r, rebuild_ns=(5200,)), 13_100, 12.0)
    with pytest.raises(InvalidSwapPlan, match="accessed at tick 4 while dropped"):
        validate_swaps(
            NET, SwapPlan(recomputes=(replace(DROP_A, drop_after=Tick(2)),)), r, 13_100, 12.0
        )
    with pytest.raises(InvalidSwapPlan, match="not the simulation"):
        validate_swaps(NET, SwapPlan(), r, 13_100, 12.0)
