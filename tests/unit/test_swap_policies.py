"""planner/swap, tidalpool_swap, autoswap_bo, combined and validate_swaps: repeated swaps below
load_min, the op-wise bound, the tuned score, the engine-aware policy against every baseline,
the combined plan's pieces, and the independent check of simulated timelines."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from tidalcore.units import Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.autoswap import autoswap, load, load_min, op_bound
from tidalplan.autoswap_bo import cost, tune
from tidalplan.combined import combine, fit, pieces
from tidalplan.gap_cover import RULES, construct, gaps
from tidalplan.learn import extract
from tidalplan.model import Iteration, Recompute, Swap, SwapPlan
from tidalplan.policies import BASELINE_POLICIES, POLICIES, plan, plans
from tidalplan.simulate import simulate
from tidalplan.validate import InvalidSwapPlan, validate_swaps

from ..conftest import shared_file
from .iterations import build

REPO = Path(__file__).resolve().parents[2]

# A is used at t1, t5 and t9; X and Y come and go between. Load:
#   t  0    1    2    3    4    5    6    7    8    9    10
#      aA   oA   aX   oX   fX   oA   aY   oY   fY   oA   fA
#      100  100  400  400  100  100  400  400  100  100  0
# The peak is t2; AutoSwap's only candidate there is A over (1, 5), so load_min is the
# other peak, t6 (400). Below it A must go again, over (5, 9).
TWICE_STEPS = ["a A 100", "o 10 A", "a X 300", "o 10 X", "f X", "o 10 A"]
TWICE = build([*TWICE_STEPS, "a Y 300", "o 10 Y", "f Y", "o 10 A", "f A"])


def test_below_load_min_a_block_is_swapped_again() -> None:
    assert int(load(TWICE).max()) == 400
    assert load_min(TWICE) == 400
    got = autoswap(TWICE, 300, 100.0, 100.0)
    assert [(s.block, s.out_after, s.in_before) for s in got.swaps] == [(0, 1, 5), (0, 5, 9)]
    r = simulate(TWICE, got, 300, 100.0, 100.0)
    assert r.feasible and r.peak_bytes == 300 and (r.out_bytes, r.in_bytes) == (200, 200)
    validate_swaps(TWICE, got, r, 300, 100.0)
    # Above load_min one swap is enough, and nothing can reach below the op-wise bound.
    assert len(autoswap(TWICE, 400, 100.0, 100.0).swaps) == 0
    assert op_bound(TWICE) == 300


def test_op_bound_counts_every_distinct_block_an_op_touches() -> None:
    it = build(["a A 100", "a B 50", "o 10 A >B", "o 10 A A", "f A", "f B"], {"W": 7})
    assert op_bound(it) == 150
    it = build(["a A 100", "o 10 A W", "f A"], {"W": 7})
    assert op_bound(it) == 107


def test_gaps_cover_every_pair_of_consecutive_accesses() -> None:
    it = build(["a A 100", "o 10 A W", "o 10", "o 10 A", "o 10 W", "f A"], {"W": 7})
    got = [(g.block, g.persistent, g.a, g.c) for g in gaps(it, 1.0, 1.0)]
    # A: (1, 3); W: (1, 4) inside the iteration and (4, 1) across its boundary.
    assert got == [(0, False, 1, 3), (0, True, 1, 4), (0, True, 4, 1)]


def _resnet() -> Iteration:
    events = read_trace_csv(shared_file("traces/models/resnet50.b32.trace.csv"))
    return extract(events, events.marks())


def test_bo_is_never_worse_than_the_pure_scores_and_is_seeded() -> None:
    it = _resnet()
    limit = int(0.9 * int(load(it).max()))
    tuned = tune(it, limit, 50.0, 50.0, trials=6)
    for score in ("aoa", "doa", "wdoa", "swdoa"):
        r = simulate(it, autoswap(it, limit, 50.0, 50.0, score=score), limit, 50.0, 50.0)
        assert cost(tuned.result, limit) <= cost(r, limit)
    again = tune(it, limit, 50.0, 50.0, trials=6)
    assert again.weights == tuned.weights and again.plan == tuned.plan
    with pytest.raises(ValueError, match="trials"):
        tune(it, limit, 50.0, 50.0, trials=0)


@pytest.mark.parametrize(
    ("fraction", "gbps"), [(0.95, 12.0), (0.7, 12.0), (0.9, 50.0), (0.5, 50.0)]
)
def test_tidalpool_is_at_least_as_good_as_every_baseline(fraction: float, gbps: float) -> None:
    it = _resnet()
    limit = int(fraction * int(load(it).max()))
    made = plans(it, POLICIES, limit, gbps, gbps)
    results = {n: simulate(it, p, limit, gbps, gbps) for n, p in made.items()}
    mine = results["tidalpool"]
    for name, r in results.items():
        if r.feasible:
            validate_swaps(it, made[name], r, limit, gbps)
            assert mine.feasible and mine.overhead <= r.overhead, name
    assert mine.feasible


def test_engine_aware_plan_hides_what_vdnn_cannot() -> None:
    it = _resnet()
    limit = int(0.95 * int(load(it).max()))
    best = min(
        simulate(it, p(it, limit, 50.0, 50.0), limit, 50.0, 50.0).overhead
        for name, p in BASELINE_POLICIES.items()
        if name.startswith("vdnn")  # layer classes, whatever the copy engines can hide
    )
    assert best > 0.005
    for rule in RULES:
        r = simulate(it, construct(it, limit, 50.0, 50.0, rule), limit, 50.0, 50.0)
        assert r.feasible and r.overhead <= 0.005, rule


def test_policies_by_name() -> None:
    assert POLICIES[-1] == "tidalpool" and "autoswap-bo" in POLICIES and "vdnn-dyn" in POLICIES
    assert {"superneurons", "capuchin", "checkmate"} <= set(BASELINE_POLICIES)
    with pytest.raises(ValueError, match="unknown memory policy 'lru'"):
        plan(TWICE, "lru", 300, 1.0, 1.0)
    assert plan(TWICE, "tidalpool", 300, 100.0, 100.0) == plan(
        TWICE, "tidalpool", 300, 100.0, 100.0
    )


# As in test_simulate: A (1000 B) away from after t1 until before t7; B lives over t3..t5.
#   t0 a A   t1 op 100   t2 op 2000   t3 a B   t4 op 3000   t5 f B   t6 op 1500   t7 op 500 A
# At 1 GB/s A's out ends at 1100 (seen by t3), its in starts at t6 (5100).
HIDE = build(
    ["a A 1000", "o 100 A", "o 2000", "a B 1000", "o 3000 B", "f B", "o 1500", "o 500 A", "f A"]
)
SWAP_A = SwapPlan((Swap(block=0, out_after=Tick(1), in_before=Tick(7)),))


def test_combined_pieces_and_footprint() -> None:
    r = simulate(HIDE, SWAP_A, None, 1.0, 1.0)
    assert r.swap_ticks == ((3, 6),) and r.swap_ns == ((1100, 5100),)
    split = pieces(HIDE, SWAP_A, r)
    assert sorted((b.size, b.start, b.end) for b in split.blocks) == [
        (1000, 0, 3),  # A until its bytes are seen gone
        (1000, 3, 5),  # B
        (1000, 5, 8),  # A again, from the tick before its swap-in started
    ]
    assert (
        combine(HIDE, SwapPlan(), simulate(HIDE, SwapPlan(), None, 1.0, 1.0), 1).footprint == 2000
    )
    assert combine(HIDE, SWAP_A, r, alignment=1).footprint == 1000
    with pytest.raises(ValueError, match="infeasible"):
        pieces(HIDE, SwapPlan(), simulate(HIDE, SwapPlan(), 1999, 1.0, 1.0))


def test_fit_lowers_the_schedules_limit_until_its_placement_fits() -> None:
    events = read_trace_csv(shared_file("traces/models/mobilenet_v3_large.b64.trace.csv"))
    it = extract(events, events.marks())
    limit = int(0.8 * load(it).max())
    first = plan(it, "autoswap-aoa", limit, 50.0, 50.0)
    # Placed by the first greedy run only (time_limit_s=0): the same footprints on any machine.
    placed = combine(it, first, simulate(it, first, limit, 50.0, 50.0), time_limit_s=0)
    assert placed.footprint > limit  # the premise: fragmentation on top of the live bytes
    got = fit(it, "autoswap-aoa", limit, 50.0, 50.0, time_limit_s=0)
    assert got.fits and got.rounds >= 2 and got.limit == limit
    assert got.combined is not None and got.combined.footprint <= limit < placed.footprint
    assert got.result.feasible and got.result.peak_bytes <= got.planned_for < limit
    assert got.schedule == plan(it, "autoswap-aoa", got.planned_for, 50.0, 50.0)  # deterministic
    # With no time left after the first round (budget_s=0), no other starts: the schedule made
    # for the limit itself, which does not fit placed.
    hurried = fit(it, "autoswap-aoa", limit, 50.0, 50.0, time_limit_s=0, budget_s=0)
    assert (hurried.rounds, hurried.fits, hurried.planned_for) == (1, False, limit)
    # Nor does its placement solve run past the budget: the first greedy run alone, whatever
    # time_limit_s allows.
    rushed = fit(it, "autoswap-aoa", limit, 50.0, 50.0, time_limit_s=60, budget_s=0)
    assert rushed.combined is not None and rushed.combined.footprint == placed.footprint
    # A policy given as a function makes the same plan as its name.
    again = fit(it, BASELINE_POLICIES["autoswap-aoa"], limit, 50.0, 50.0, time_limit_s=0)
    assert again == got
    # One round: the schedule for the limit itself, placed over it, does not count.
    one = fit(it, "autoswap-aoa", limit, 50.0, 50.0, rounds=1, time_limit_s=0)
    assert not one.fits and one.footprint == placed.footprint and one.planned_for == limit
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        fit(it, "autoswap-aoa", limit, 50.0, 50.0, rounds=0)


def test_a_recomputed_block_is_placed_in_two_pieces_and_its_rebuild_scratch_in_one() -> None:
    # A is dropped after t5 and rebuilt for t9 by the op at t3, which also writes S: A's
    # pieces are [1, 6) and [9, 10), the scratch [9, 10); B fits in A's bytes between.
    it = build(
        [
            "a X 10",  # 0
            "a A 100",  # 1
            "a S 5",  # 2
            "o 10 X >A >S",  # 3
            "f S",  # 4
            "o 10 A",  # 5
            "a B 100",  # 6
            "o 10 B",  # 7
            "f B",  # 8
            "o 10 A X",  # 9
            "f A",  # 10
            "f X",  # 11
        ]
    )
    schedule = SwapPlan(recomputes=(Recompute(block=1, drop_after=Tick(5), before=Tick(9)),))
    r = simulate(it, schedule, 115, 1.0, 1.0)
    assert r.feasible and r.recompute_ns == 10
    done = combine(it, schedule, r, alignment=1)
    pieces_of_a = [b for b in done.pieces.blocks if done.origin[b.id] == ("block", 1)]
    assert sorted((b.start, b.end) for b in pieces_of_a) == [(1, 6), (9, 10)]
    scratch = [b for b in done.pieces.blocks if done.origin[b.id][0] == "scratch"]
    assert [(b.start, b.end, b.size) for b in scratch] == [(9, 10, 5)]
    assert done.footprint == 115  # X, and A or B, and S or the scratch
    assert combine(it, SwapPlan(), simulate(it, SwapPlan(), None, 1.0, 1.0), 1).footprint == 210


def test_validate_swaps_catches_a_late_swap_in_and_an_overfull_tick() -> None:
    r = simulate(HIDE, SWAP_A, None, 1.0, 1.0)
    validate_swaps(HIDE, SWAP_A, r, 1000, 1.0)
    with pytest.raises(InvalidSwapPlan, match=r"tick 3 .* 2000 device bytes > 1000"):
        validate_swaps(HIDE, SWAP_A, dataclasses.replace(r, swap_ticks=((4, 6),)), 1000, 1.0)
    with pytest.raises(InvalidSwapPlan, match="back at 6700 ns but op 7 began at 6600 ns"):
        validate_swaps(HIDE, SWAP_A, dataclasses.replace(r, swap_ns=((1100, 5700),)), None, 1.0)
    with pytest.raises(InvalidSwapPlan, match="never happened"):
        validate_swaps(HIDE, SWAP_A, dataclasses.replace(r, swap_ticks=((3, -1),)), None, 1.0)
    with pytest.raises(InvalidSwapPlan, match="not the simulation"):
        validate_swaps(HIDE, SWAP_A, simulate(HIDE, SwapPlan(), None, 1.0, 1.0), None, 1.0)


# W (300 B, persistent) is read at t0 and updated at t5; A (200 B) lives over t1..t4. The
# peak (500) can only come down by taking W away over (0, 5): the policies that move transient
# blocks only cannot (A is needed throughout); AutoSwap (with weights, VI-B3) and tidalpool
# reach the op-wise bound.
WEIGHTS = build(["o 10 W", "a A 200", "o 10 A", "o 10 A", "f A", "o 10 W"], {"W": 300})


def test_swapping_weights_reaches_the_op_wise_bound() -> None:
    assert (int(load(WEIGHTS).max()), op_bound(WEIGHTS)) == (500, 300)
    made = plans(WEIGHTS, POLICIES, 300, 100.0, 100.0)
    for name, p in made.items():
        r = simulate(WEIGHTS, p, 300, 100.0, 100.0)
        assert r.feasible == (name.startswith("autoswap") or name == "tidalpool"), name
        if r.feasible:
            validate_swaps(WEIGHTS, p, r, 300, 100.0)
            assert r.peak_bytes == 300
    mine = made["tidalpool"]
    assert [(s.block, s.persistent, s.out_after, s.in_before) for s in mine.swaps] == [
        (0, True, 0, 5)
    ]
    assert not simulate(WEIGHTS, plan(WEIGHTS, "tidalpool", 299, 1.0, 1.0), 299, 1.0, 1.0).feasible


def test_tidalpool_beats_every_baseline_where_copies_must_stall() -> None:
    it = _resnet()
    limit = int(0.8 * int(load(it).max()))
    made = plans(it, POLICIES, limit, 50.0, 50.0)
    overhead = {n: simulate(it, p, limit, 50.0, 50.0).overhead for n, p in made.items()}
    best = min(o for n, o in overhead.items() if n != "tidalpool")
    assert overhead["tidalpool"] < 0.95 * best


def test_the_integer_programs_write_nothing_to_stdout() -> None:
    """The search's programs are silenced through the solver's own options: in a fresh
    process (HiGHS writes its banner once per process), only what the caller prints reaches
    stdout, where `tidalpool simulate --json` writes."""
    code = (
        "from tests.unit.test_swap_policies import TWICE\n"
        "from tidalplan.policies import plan\n"
        "print(len(plan(TWICE, 'tidalpool', 300, 100.0, 100.0).swaps))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout) == (0, "2\n"), out.stderr


_ORDER = """
import sys
from tidaloffline.formats import read_trace_csv
from tidalplan.autoswap import load
from tidalplan.learn import extract
from tidalplan.policies import plan
events = read_trace_csv(sys.argv[1])
it = extract(events, events.marks())
limit = int(0.95 * int(load(it).max()))
for name in sys.argv[2:]:
    made = plan(it, name, limit, 12.0, 12.0)
print(made)
"""


def test_a_plan_does_not_depend_on_the_programs_solved_before_it() -> None:
    """HiGHS sizes one task scheduler per process by the first solver that runs: a program
    run after a multi-threaded one would end elsewhere at its node limit. In fresh processes,
    tidalpool's plan alone and after checkmate's integer program are the same."""
    trace = str(shared_file("traces/models/resnet50.b32.trace.csv"))
    alone, after = (
        subprocess.run(
            [sys.executable, "-c", _ORDER, trace, *names],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout
        for names in (["tidalpool"], ["checkmate", "tidalpool"])
    )
    assert alone and alone == after
