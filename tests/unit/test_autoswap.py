"""planner/autoswap: candidates, the four priority scores and the greedy picks worked out by hand
on a small iteration, the plans judged by `simulate`, and the numbers on a real model trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tidalcore.units import Bytes, Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.autoswap import (
    SCORES,
    Candidate,
    aoa,
    autoswap,
    candidates,
    doa,
    durations,
    load,
    load_min,
    scores,
    swap_in_tick,
    wdoa,
)
from tidalplan.learn import extract
from tidalplan.model import Swap, SwapPlan
from tidalplan.simulate import no_limit, simulate

from .iterations import build

RESNET = Path(__file__).resolve().parents[3] / "shared/traces/models/resnet50.b32.trace.csv"


# Load (W = 10 persistent bytes + live) at each tick:
#   t  0    1    2    3    4    5    6    7    8    9    10   11   12   13   14
#      aA   o10  aB   o20  aC   o30  aD   o40  fD   o50  o60  o70  fA   fB   fC
#      110  110  310  310  360  360  760  760  360  360  360  360  260  60   10
# The peak is t6 (760). A: accesses t1, t11, gap (1, 11) of 20+30+40+50+60 = 200 ns;
# B: t3, t10, gap (3, 10) of 30+40+50 = 120 ns; C: t5, t9, gap (5, 9) of 40 ns;
# D is live at the peak but accessed only at t7: no gap, never a candidate.
HAND = build(
    [
        "a A 100",
        "o 10 A",
        "a B 200",
        "o 20 B",
        "a C 50",
        "o 30 C",
        "a D 400",
        "o 40 D",
        "f D",
        "o 50 C",
        "o 60 B",
        "o 70 A",
        "f A",
        "f B",
        "f C",
    ],
    {"W": 10},
)
A = Candidate(block=0, size=Bytes(100), out_after=Tick(1), in_before=Tick(11), gap_ns=200)
B = Candidate(block=1, size=Bytes(200), out_after=Tick(3), in_before=Tick(10), gap_ns=120)
C = Candidate(block=2, size=Bytes(50), out_after=Tick(5), in_before=Tick(9), gap_ns=40)
GBPS = 2.0  # copies: A 50 ns, B 100 ns, C 25 ns each way


def test_load_and_durations() -> None:
    want = [110, 110, 310, 310, 360, 360, 760, 760, 360, 360, 360, 360, 260, 60, 10]
    assert load(HAND).tolist() == want
    assert durations(HAND).tolist() == [0, 10, 0, 20, 0, 30, 0, 40, 0, 50, 60, 70, 0, 0, 0]


def test_candidates_filter_by_threshold_and_gap() -> None:
    assert candidates(HAND, 0) == [A, B, C]
    assert candidates(HAND, 51) == [A, B]
    assert candidates(HAND, 100) == [A, B]
    assert candidates(HAND, 101) == [B]
    assert candidates(build([]), 0) == []


def test_doa_subtracts_both_copies() -> None:
    assert [doa(c, GBPS, GBPS) for c in (A, B, C)] == [200 - 100, 120 - 200, 40 - 50]
    assert doa(B, 4.0, 1.0) == 120 - 50 - 200


def test_aoa_times_size_or_over_size_when_negative() -> None:
    assert [aoa(c, GBPS, GBPS) for c in (A, B, C)] == [100 * 100, -80 / 200, -10 / 50]
    assert [aoa(c, GBPS, GBPS) for c in (A, B, C)] == [10000.0, -0.4, -0.2]


def test_wdoa_is_area_under_the_load_over_the_gap() -> None:
    curve, dur = load(HAND), durations(HAND)
    # A over t3 t5 t7 t9 t10: 310·20 + 360·30 + 760·40 + 360·50 + 360·60
    assert wdoa(A, curve, dur) == 6200 + 10800 + 30400 + 18000 + 21600 == 87000
    assert wdoa(B, curve, dur) == 10800 + 30400 + 18000 == 59200
    assert wdoa(C, curve, dur) == 30400


def test_swdoa_uses_the_load_after_earlier_picks() -> None:
    original, dur = load(HAND), durations(HAND)
    current = original.copy()
    current[2:11] -= 100  # A taken off over its gap
    got = scores([B, C], "swdoa", original, current, dur, GBPS, GBPS)
    assert got == [260.0 * 30 + 660 * 40 + 260 * 50, 660.0 * 40] == [47200.0, 26400.0]
    assert scores([B, C], "wdoa", original, current, dur, GBPS, GBPS) == [59200.0, 30400.0]


def test_combined_is_equation_3_over_standardized_scores() -> None:
    curve, dur = load(HAND), durations(HAND)
    # DOA 100, -80, -10: mean 10/3, population sd sqrt(16800)/3 ≈ 74.38
    d = np.array([100.0, -80.0, -10.0])
    z = ((d - d.mean()) / d.std()).tolist()
    got = scores([A, B, C], "combined", curve, curve, dur, GBPS, GBPS, (0.0, 1.0, 0.0, 0.0))
    assert got == pytest.approx(z, abs=1e-12)
    assert got[0] > got[2] > got[1]
    both = scores([A, B, C], "combined", curve, curve, dur, GBPS, GBPS, (0.0, 0.0, 1.0, 1.0))
    assert both == pytest.approx(
        [2 * x for x in scores([A, B, C], "combined", curve, curve, dur, GBPS, GBPS)], abs=1e-12
    )
    same = Candidate(block=5, size=Bytes(1), out_after=Tick(1), in_before=Tick(3), gap_ns=0)
    assert scores([same, same], "combined", curve, curve, dur, 1.0, 1.0) == [0.0, 0.0]
    with pytest.raises(ValueError, match="unknown score"):
        scores([A], "bogus", curve, curve, dur, 1.0, 1.0)  # type: ignore[arg-type]


def test_swap_in_is_issued_as_late_as_the_copy_hides() -> None:
    assert swap_in_tick(HAND, A, GBPS) == 10  # 50 ns ≤ op t10 (60)
    assert swap_in_tick(HAND, B, GBPS) == 5  # 100 ns: t9 50 + t7 40 + t5 30
    assert swap_in_tick(HAND, C, GBPS) == 7  # 25 ns ≤ op t7 (40)
    assert swap_in_tick(HAND, C, 0.5) == 6  # 100 ns > 40: no earlier than out_after + 1


# Greedy to a limit of 500 (peak 760). Taking A off ticks 2..10 leaves 660 at t6-7; B (4..9)
# then leaves 460, and the highest tick is t11 (360): peak 460. C (6..8) after A leaves 610.
#   doa   (100, -80, -10): A, C, B   → 660, 610, 410
#   aoa   (10000, -0.4, -0.2): A, C, B
#   wdoa  (87000, 59200, 30400): A, B → 660, 460
#   swdoa (87000, 59200, 30400), then (47200, 26400): A, B
PICKS = {"doa": (A, C, B), "aoa": (A, C, B), "wdoa": (A, B), "swdoa": (A, B)}
IN_AT = {0: 10, 1: 5, 2: 7}


@pytest.mark.parametrize("score", ["doa", "aoa", "wdoa", "swdoa"])
def test_greedy_picks_in_score_order_until_the_limit(score: str) -> None:
    plan = autoswap(HAND, 500, GBPS, GBPS, score)  # type: ignore[arg-type]
    want = tuple(
        Swap(c.block, c.out_after, c.in_before, Tick(IN_AT[c.block])) for c in PICKS[score]
    )
    assert plan == SwapPlan(want)
    r = simulate(HAND, plan, 500, GBPS, GBPS)
    assert r.feasible
    assert r.peak_bytes <= 500
    assert simulate(HAND, plan, 759, GBPS, GBPS).feasible
    assert not simulate(HAND, SwapPlan(), 759, GBPS, GBPS).feasible


def test_combined_with_one_weight_follows_that_score() -> None:
    assert autoswap(HAND, 500, GBPS, GBPS, "combined", (0.0, 1.0, 0.0, 0.0)) == autoswap(
        HAND, 500, GBPS, GBPS, "doa"
    )
    assert autoswap(HAND, 500, GBPS, GBPS, "combined") == autoswap(HAND, 500, GBPS, GBPS, "swdoa")


def test_swap_in_schedule_times_in_simulate() -> None:
    # swdoa plan at 500: A out 10..60, B out 60..160; D's malloc at t6 (60) waits for B's
    # release (160); B's swap-in cannot fit until D is freed at t8 (200): 200..300, so op t10
    # stalls 50 ns; A's swap-in, issued at t10 (250), runs 300..350 under op t10 (300..360).
    r = simulate(HAND, autoswap(HAND, 500, GBPS, GBPS), 500, GBPS, GBPS)
    assert (r.iteration_ns, r.baseline_ns, r.stall_ns, r.peak_bytes) == (430, 280, 150, 460)


def test_no_swaps_when_the_peak_already_fits() -> None:
    assert autoswap(HAND, 760, GBPS, GBPS) == SwapPlan()
    assert autoswap(HAND, 10**9, GBPS, GBPS, "doa") == SwapPlan()


def test_every_candidate_when_the_limit_is_below_load_min() -> None:
    plan = autoswap(HAND, 100, GBPS, GBPS, "wdoa")
    assert [s.block for s in plan.swaps] == [0, 1, 2]
    assert autoswap(HAND, 100, GBPS, GBPS, "wdoa", threshold_bytes=60).swaps == plan.swaps[:2]


def test_load_min_takes_every_candidate_off() -> None:
    # t6-7: 760 - 100 - 200 - 50 = 410; no other tick is higher (t11: 360).
    assert load_min(HAND) == 410
    assert load_min(HAND, threshold_bytes=60) == 460
    assert load_min(HAND, threshold_bytes=1000) == 760
    assert load_min(build([])) == 0


def test_unknown_score_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown score"):
        autoswap(HAND, 500, GBPS, GBPS, "bogus")  # type: ignore[arg-type]
    assert SCORES == ("doa", "aoa", "wdoa", "swdoa", "combined")


@pytest.mark.skipif(not RESNET.exists(), reason=f"no trace at {RESNET}")
def test_resnet50_plans_are_accepted_by_simulate() -> None:
    events = read_trace_csv(RESNET)
    it = extract(events, events.marks())
    base = no_limit(it)
    peak = int(base.peak_bytes)
    floor = load_min(it)
    assert 0 < floor <= peak
    limit = int(0.8 * peak)
    lines = [f"resnet50: peak {peak}, load_min {floor} ({floor / peak:.3f} of peak)"]
    for score in SCORES:
        plan = autoswap(it, limit, 12.0, 12.0, score)
        r = simulate(it, plan, limit, 12.0, 12.0)
        lines.append(
            f"  {score}: {len(plan.swaps)} swaps, feasible {r.feasible}, "
            f"overhead {r.overhead:.4f}, peak {r.peak_bytes}"
        )
        if floor <= limit and r.feasible:
            assert r.peak_bytes <= limit
    print("\n".join(lines))
