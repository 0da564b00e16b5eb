"""planner/simulate: exact times, stalls and bytes on hand-built iterations whose timelines are
worked out in the comments, and the no-swap baseline on a real model trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from tidalcore.units import Bytes, Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.learn import extract, live_bytes
from tidalplan.model import Swap, SwapPlan
from tidalplan.simulate import Result, copy_ns, no_limit, simulate

from .iterations import build

RESNET = Path(__file__).resolve().parents[3] / "shared/traces/models/resnet50.b32.trace.csv"


TWO = build(["a A 100", "o 1000 A", "a B 50", "o 2000 B", "f A", "o 500 B", "f B"], {"W": 10})

# A (1000 B) leaves after op t1 and comes back for op t7; B is live over t3..t5 only.
#   t0 a A   t1 op 100   t2 op 2000   t3 a B   t4 op 3000   t5 f B   t6 op 1500   t7 op 500   t8 f A
# At 1 GB/s a copy of A takes 1000 ns: out 100..1100, in issued at t6 (5100), 5100..6100.
HIDE = build(
    ["a A 1000", "o 100 A", "o 2000", "a B 1000", "o 3000 B", "f B", "o 1500", "o 500 A", "f A"]
)
SWAP_A = SwapPlan((Swap(block=0, out_after=Tick(1), in_before=Tick(7)),))


def test_no_swaps_no_limit_is_the_trace() -> None:
    r = simulate(TWO, SwapPlan(), None, 10.0, 10.0)
    assert r == Result(
        iteration_ns=3500,
        baseline_ns=3500,
        overhead=0.0,
        peak_bytes=Bytes(160),  # W + A + B
        out_bytes=Bytes(0),
        in_bytes=Bytes(0),
        stall_ns=0,
        feasible=True,
        curve=((0, 10), (0, 110), (1000, 160), (3000, 60), (3500, 10)),
    )
    assert no_limit(TWO) == r


def test_compute_scale_multiplies_op_times() -> None:
    r = simulate(TWO, SwapPlan(), None, 10.0, 10.0, compute_scale=2.0)
    assert (r.iteration_ns, r.baseline_ns, r.overhead, r.stall_ns) == (7000, 7000, 0.0, 0)
    assert r.curve == ((0, 10), (0, 110), (2000, 160), (6000, 60), (7000, 10))


def test_copy_ns_rounds_up_exactly() -> None:
    assert copy_ns(1000, 1.0) == 1000
    assert copy_ns(1001, 2.0) == 501
    assert copy_ns(3, 0.1) == 30  # 0.1 is not exact in binary; the ceiling must not say 31


def test_hidden_swap_costs_nothing_and_lowers_the_peak() -> None:
    assert no_limit(HIDE).peak_bytes == 2000
    r = simulate(HIDE, SWAP_A, None, 1.0, 1.0)
    assert r == Result(
        iteration_ns=7100,
        baseline_ns=7100,
        overhead=0.0,
        peak_bytes=Bytes(1000),
        out_bytes=Bytes(1000),
        in_bytes=Bytes(1000),
        stall_ns=0,
        feasible=True,
        curve=((0, 0), (0, 1000), (1100, 0), (2100, 1000), (5100, 0), (5100, 1000), (7100, 0)),
    )
    assert simulate(HIDE, SWAP_A, 1000, 1.0, 1.0) == r  # it fits a 1000-byte limit as well


def test_late_swap_in_stalls_compute() -> None:
    # At 0.5 GB/s the swap-in takes 2000 ns: 5100..7100, but op t7 is ready at 6600.
    r = simulate(HIDE, SWAP_A, None, 1.0, 0.5)
    assert (r.iteration_ns, r.stall_ns, r.peak_bytes) == (7600, 500, 1000)
    assert r.overhead == 7600 / 7100 - 1


def test_explicit_in_at_issues_the_swap_in_later() -> None:
    plan = SwapPlan((Swap(block=0, out_after=Tick(1), in_before=Tick(7), in_at=Tick(7)),))
    r = simulate(HIDE, plan, None, 1.0, 1.0)  # issued when compute reaches t7 (6600)
    assert (r.iteration_ns, r.stall_ns) == (8100, 1000)


def test_malloc_waits_for_a_swap_out() -> None:
    # At 0.25 GB/s the swap-out takes 4000 ns: 100..4100. The alloc of B at 2100 needs A's
    # bytes under a 1000-byte limit: it waits until 4100. Then t4 4100..7100, in 7100..8100
    # (hidden under t6 7100..8600), t7 8600..9100.
    r = simulate(HIDE, SWAP_A, 1000, 0.25, 1.0)
    assert (r.iteration_ns, r.stall_ns, r.peak_bytes, r.feasible) == (9100, 2000, 1000, True)
    assert r.curve[:4] == ((0, 0), (0, 1000), (4100, 0), (4100, 1000))


def test_infeasible_limits_are_reported() -> None:
    r = simulate(HIDE, SWAP_A, 999, 1.0, 1.0)  # A alone does not fit
    assert (r.feasible, r.iteration_ns, r.out_bytes) == (False, 0, 0)
    r = simulate(HIDE, SwapPlan(), 1999, 1.0, 1.0)  # A and B are both live at t3
    assert (r.feasible, r.iteration_ns, r.peak_bytes) == (False, 2100, 1000)
    assert not simulate(TWO, SwapPlan(), 9, 1.0, 1.0).feasible  # W alone exceeds it


# X leaves after t2 and returns for t6; Y leaves after t4 and returns for t8 (1000 B, 1 GB/s).
# Y's swap-out (1200..2200) and X's swap-in (1200..2200) run at the same time.
PAIR_STEPS = ["a X 1000", "a Y 1000", "o 100 X", "o 1000", "o 100 Y", "o 1000"]
PAIR_STEPS += ["o 100 X", "o 1000", "o 100 Y", "f X", "f Y"]
PAIR = build(PAIR_STEPS)
PAIR_PLAN = SwapPlan(
    (
        Swap(block=0, out_after=Tick(2), in_before=Tick(6)),
        Swap(block=1, out_after=Tick(4), in_before=Tick(8)),
    )
)


def test_out_and_in_engines_run_side_by_side() -> None:
    r = simulate(PAIR, PAIR_PLAN, None, 1.0, 1.0)
    assert (r.iteration_ns, r.stall_ns, r.out_bytes, r.in_bytes) == (3400, 0, 2000, 2000)
    assert r.curve == (
        (0, 0),
        (0, 1000),
        (0, 2000),
        (1100, 1000),  # X out
        (1200, 2000),  # X in starts
        (2200, 1000),  # Y out
        (2300, 2000),  # Y in starts
        (3400, 1000),
        (3400, 0),
    )


def test_swap_in_waits_on_its_own_engine() -> None:
    # At 0.5 GB/s copies take 2000 ns. X out 100..2100; Y out waits for it: 2100..4100.
    # X in is issued at t5 (1200) but starts when X out ends: 2100..4100, so t6 waits
    # 4100 - 2200 = 1900 and runs 4100..4200. Y in is issued at t7 (4200): 4200..6200, and
    # t8 waits 6200 - 5200 = 1000.
    r = simulate(PAIR, PAIR_PLAN, None, 0.5, 0.5)
    assert (r.iteration_ns, r.stall_ns) == (6300, 2900)


# W (500 B, persistent) is read by t1 only: it leaves after t1 and returns before t1 of the
# next iteration, so it is off the device when the iteration begins.
WRAP = build(["o 1000", "o 1000 W", "o 1000", "a X 1000", "o 1000 X", "f X"], {"W": 500})


def test_persistent_block_swaps_across_the_boundary() -> None:
    plan = SwapPlan((Swap(block=0, out_after=Tick(1), in_before=Tick(1), persistent=True),))
    r = simulate(WRAP, plan, 1000, 1.0, 1.0)  # in 0..500 (issued at t0), out 2000..2500
    assert r == Result(
        iteration_ns=4000,
        baseline_ns=4000,
        overhead=0.0,
        peak_bytes=Bytes(1000),
        out_bytes=Bytes(500),
        in_bytes=Bytes(500),
        stall_ns=0,
        feasible=True,
        curve=((0, 0), (0, 500), (2500, 0), (3000, 1000), (4000, 0)),
    )
    assert not simulate(WRAP, SwapPlan(), 1000, 1.0, 1.0).feasible


def test_bad_plans_are_refused() -> None:
    bad = [
        Swap(block=5, out_after=Tick(1), in_before=Tick(7)),  # no such block
        Swap(block=0, out_after=Tick(0), in_before=Tick(7)),  # not an op tick
        Swap(block=0, out_after=Tick(7), in_before=Tick(1)),  # transient cannot wrap
        Swap(block=0, out_after=Tick(1), in_before=Tick(7), in_at=Tick(1)),  # before the out
        Swap(block=1, out_after=Tick(1), in_before=Tick(4)),  # B is not live at t1
    ]
    for swap in bad:
        with pytest.raises(ValueError):
            simulate(HIDE, SwapPlan((swap,)), None, 1.0, 1.0)
    with pytest.raises(ValueError, match="accessed at tick 4"):
        simulate(PAIR, SwapPlan((Swap(block=1, out_after=Tick(2), in_before=Tick(8)),)), None, 1, 1)
    with pytest.raises(ValueError, match="overlaps"):
        simulate(HIDE, SwapPlan(SWAP_A.swaps * 2), None, 1.0, 1.0)
    with pytest.raises(ValueError):
        simulate(HIDE, SWAP_A, None, 0.0, 1.0)


def test_deterministic() -> None:
    first = simulate(PAIR, PAIR_PLAN, 1500, 0.7, 0.3, 1.3)
    assert simulate(PAIR, PAIR_PLAN, 1500, 0.7, 0.3, 1.3) == first
    again = build(list(PAIR_STEPS))
    assert simulate(again, PAIR_PLAN, 1500, 0.7, 0.3, 1.3) == first


@pytest.mark.skipif(not RESNET.exists(), reason=f"no trace at {RESNET}")
def test_resnet50_without_swaps_is_the_trace() -> None:
    events = read_trace_csv(RESNET)
    it = extract(events, events.marks())
    r = no_limit(it)
    assert r.feasible
    assert r.iteration_ns == r.baseline_ns == sum(op.duration_ns for op in it.ops) > 0
    assert r.peak_bytes == sum(s for _, s in it.persistent) + int(live_bytes(it).max())
    assert (r.stall_ns, r.out_bytes, r.in_bytes) == (0, 0, 0)


# A is used at t1, t3 and t5 and swapped over both gaps. At 1 GB/s each copy takes 1000 ns:
#   out1 100..1100, in1 (issued at t2, 100) waits for out1: 1100..2100, t3 2100..2200,
#   out2 2200..3200, in2 (issued at t4, 2200) waits for out2: 3200..4200, t5 4200..4300.
THRICE = build(["a A 1000", "o 100 A", "o 2000", "o 100 A", "o 2000", "o 100 A", "f A"])
TWICE = SwapPlan(
    (
        Swap(block=0, out_after=Tick(1), in_before=Tick(3)),
        Swap(block=0, out_after=Tick(3), in_before=Tick(5)),
    )
)


def test_a_block_swapped_twice_over_disjoint_gaps() -> None:
    r = simulate(THRICE, TWICE, None, 1.0, 1.0)
    assert (r.iteration_ns, r.overhead, r.stall_ns) == (4300, 0.0, 0)
    assert (r.out_bytes, r.in_bytes, r.peak_bytes) == (2000, 2000, 1000)
    assert r.curve == (
        (0, 0),
        (0, 1000),
        (1100, 0),
        (1100, 1000),
        (3200, 0),
        (3200, 1000),
        (4300, 0),
    )
    # Overlapping intervals of one block are refused, whatever their order in the plan.
    overlapping = (Swap(0, Tick(1), Tick(3)), Swap(0, Tick(2), Tick(3)))
    for swaps in (overlapping, overlapping[::-1]):
        with pytest.raises(ValueError, match="overlaps"):
            simulate(THRICE, SwapPlan(swaps), None, 1.0, 1.0)
