"""planner/autoswap: candidates, the four priority scores and the greedy picks worked out by hand
on a small iteration, the plans judged by `simulate`, and the numbers on a real model trace."""

from __future__ import annotations

from dataclasses import replace
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
    swap_in_ticks,
    wdoa,
)
from tidalplan.autoswap_bo import autoswap_bo, tune
from tidalplan.learn import extract
from tidalplan.model import Swap, SwapPlan
from tidalplan.simulate import no_limit, simulate
from tidalplan.validate import validate_swaps

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
# Swap-ins on the one serial stream, laid out backwards from the last access (IV-E). Ticks start
# at 0 0 10 10 30 30 60 60 100 100 150 210 ns. A (needed at t11, 210 ns) copies 160..210: t10.
# B (t10, 150 ns) copies 50..150: t5. With C as well, C (t9) goes first and must end by 50 ns,
# but its swap-out's op t5 ends only at 60: C is issued at t6, and B, needed after C, no
# earlier (t6, not t5).
IN_AT = {"doa": {0: 10, 1: 6, 2: 6}, "wdoa": {0: 10, 1: 5}}
IN_AT |= {"aoa": IN_AT["doa"], "swdoa": IN_AT["wdoa"]}


@pytest.mark.parametrize("score", ["doa", "aoa", "wdoa", "swdoa"])
def test_greedy_picks_in_score_order_until_the_limit(score: str) -> None:
    plan = autoswap(HAND, 500, GBPS, GBPS, score)  # type: ignore[arg-type]
    want = tuple(
        Swap(c.block, c.out_after, c.in_before, Tick(IN_AT[score][c.block])) for c in PICKS[score]
    )
    assert plan == SwapPlan(want)
    r = simulate(HAND, plan, 500, GBPS, GBPS)
    assert r.feasible
    assert r.peak_bytes <= 500
    validate_swaps(HAND, plan, r, 500, GBPS)
    assert simulate(HAND, plan, 759, GBPS, GBPS).feasible
    assert not simulate(HAND, SwapPlan(), 759, GBPS, GBPS).feasible


def test_combined_with_one_weight_follows_that_score() -> None:
    assert autoswap(HAND, 500, GBPS, GBPS, "combined", (0.0, 1.0, 0.0, 0.0)) == autoswap(
        HAND, 500, GBPS, GBPS, "doa"
    )
    assert autoswap(HAND, 500, GBPS, GBPS, "combined") == autoswap(HAND, 500, GBPS, GBPS, "swdoa")


def test_doa_plan_keeps_the_swap_in_stream_in_access_order() -> None:
    # The doa plan of 500 in simulate: 440 ns, stall 160. Issued as each copy alone would hide
    # (C at t7, B at t5), B is first in the stream, C waits behind it, and op t9 stalls: 505 ns.
    plan = autoswap(HAND, 500, GBPS, GBPS, "doa")
    r = simulate(HAND, plan, 500, GBPS, GBPS)
    assert (r.iteration_ns, r.stall_ns, r.peak_bytes) == (440, 160, 460)
    alone = SwapPlan(
        tuple(
            replace(s, in_at=swap_in_tick(HAND, c, GBPS))
            for s, c in zip(plan.swaps, (A, C, B), strict=True)
        )
    )
    assert [s.in_at for s in alone.swaps] == [10, 7, 5]
    r = simulate(HAND, alone, 500, GBPS, GBPS)
    assert (r.iteration_ns, r.stall_ns, r.peak_bytes) == (505, 225, 460)


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
    big = autoswap(HAND, 100, GBPS, GBPS, "wdoa", threshold_bytes=60)
    # The same gaps; without C ahead of it in the swap-in stream, B is issued at t5, not t6.
    assert [s.in_at for s in plan.swaps] == [10, 6, 6]
    assert big.swaps == (plan.swaps[0], replace(plan.swaps[1], in_at=Tick(5)))


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


# A weight W (300 B) is used only at t8; B (100 B) around the peak; A (200 B) only at t3.
#   t  0    1     2    3    4    5    6    7    8    9
#      aB   o100  aA   o10  fA   o100 fB   o100 o100 o100
#           >B         A         B         W
#      400  400   600  600  400  400  300  300  300  300
# Ticks start at 0 0 100 100 110 110 210 210 310 410 ns; copies at 3 GB/s: 300 B 100 ns,
# 100 B 34 ns. B's gap (1, 5) alone leaves 500 at t2-3; only W, away across the boundary from
# after t8 to before the next t8 (t9, t0..t7), brings the peak to 300.
WEIGHT = build(
    [
        "a B 100",
        "o 100 >B",
        "a A 200",
        "o 10 A",
        "f A",
        "o 100 B",
        "f B",
        "o 100",
        "o 100 W",
        "o 100",
    ],
    {"W": 300},
)
B_GAP = Candidate(block=0, size=Bytes(100), out_after=Tick(1), in_before=Tick(5), gap_ns=10)
W_GAP = Candidate(
    block=0, size=Bytes(300), out_after=Tick(8), in_before=Tick(8), gap_ns=410, persistent=True
)
W_SWAP = Swap(block=0, out_after=Tick(8), in_before=Tick(8), in_at=Tick(7), persistent=True)


def test_persistent_gaps_are_candidates_the_one_across_the_boundary_included() -> None:
    assert candidates(WEIGHT, 0) == [B_GAP, W_GAP]
    assert W_GAP.crosses and not B_GAP.crosses
    assert candidates(WEIGHT, 101) == [W_GAP]
    assert candidates(WEIGHT, 301) == []
    # W used at t0, t2, t5, t6: gaps (0, 2), (2, 5) and (6, 0) across the boundary (over t7).
    # As for transient blocks (IV-A), the candidate is the gap across the peak (t1, where A
    # is allocated); with the load's peak moved to t7, the gap across the boundary.
    it = build(
        ["o 10 W", "a A 200", "o 10 A W", "o 10 A", "f A", "o 10 W", "o 10 W", "o 10"], {"W": 300}
    )
    got = [(c.out_after, c.in_before, c.gap_ns) for c in candidates(it, 0)]
    assert got == [(0, 2, 0)]
    assert all(c.persistent and c.block == 0 for c in candidates(it, 0))
    moved = load(it)
    moved[7] += 1000
    got = [(c.out_after, c.in_before, c.gap_ns) for c in candidates(it, 0, moved)]
    assert got == [(6, 0, 10)]
    # Used once at the last op: the gap across the boundary covers every other tick.
    once = build(["o 10", "o 20", "o 30 W"], {"W": 8})
    assert candidates(once, 0) == [Candidate(0, Bytes(8), Tick(2), Tick(2), 30, persistent=True)]
    # ... and none at all when the last op is followed by nothing and the first uses it.
    assert candidates(build(["o 10 W", "o 20 W"], {"W": 8}), 0) == []


def test_scores_wrap_across_the_boundary() -> None:
    curve, dur = load(WEIGHT), durations(WEIGHT)
    # W over t9, t0..t7: 300·100 + 400·100 + 600·10 + 400·100 + 300·100 (allocs and frees: 0 ns)
    assert wdoa(W_GAP, curve, dur) == 30000 + 40000 + 6000 + 40000 + 30000 == 146000
    assert wdoa(B_GAP, curve, dur) == 600 * 10
    assert [doa(c, 3.0, 3.0) for c in (B_GAP, W_GAP)] == [10 - 68, 410 - 200]
    assert [aoa(c, 3.0, 3.0) for c in (B_GAP, W_GAP)] == [-58 / 100, 210.0 * 300]
    for score in ("wdoa", "swdoa"):
        got = scores([B_GAP, W_GAP], score, curve, curve, dur, 3.0, 3.0)
        assert got == [6000.0, 146000.0]
    current = curve.copy()
    current[2:5] -= 100  # B taken off: W's area loses 100·10 at t3
    assert scores([W_GAP], "swdoa", curve, current, dur, 3.0, 3.0) == [145000.0]
    both = scores([B_GAP, W_GAP], "combined", curve, curve, dur, 3.0, 3.0, (1.0, 1.0, 1.0, 1.0))
    assert both == [-4.0, 4.0]  # W ranks first by each of the four


def test_load_min_takes_persistent_gaps_off() -> None:
    # Both off: t2-3 600 - 100 - 300 = 200; W is needed at t8 (300), the peak.
    assert load_min(WEIGHT) == 300
    assert load_min(WEIGHT, threshold_bytes=301) == 600


@pytest.mark.parametrize("score", SCORES)
def test_only_the_weight_across_the_boundary_fits_and_autoswap_takes_it(score: str) -> None:
    plan = autoswap(WEIGHT, 300, 3.0, 3.0, score)  # type: ignore[arg-type]
    # W comes back over op t7 (210..310 ns, after B is freed at t6) and leaves after t8.
    assert plan == SwapPlan((W_SWAP,))
    r = simulate(WEIGHT, plan, 300, 3.0, 3.0)
    assert (r.feasible, r.peak_bytes, r.stall_ns, r.iteration_ns, r.baseline_ns) == (
        True,
        300,
        0,
        510,
        510,
    )
    validate_swaps(WEIGHT, plan, r, 300, 3.0)
    b_only = SwapPlan((Swap(block=0, out_after=Tick(1), in_before=Tick(5), in_at=Tick(2)),))
    assert not simulate(WEIGHT, b_only, 300, 3.0, 3.0).feasible  # t2: 300 + 200 + 0 = 500


def test_a_crossing_swap_in_is_issued_no_earlier_than_the_iteration_start() -> None:
    # At 1 GB/s W's copy takes 300 ns: it must begin by 310 - 300 = 10 ns, and t1 (0 ns) is
    # the latest tick that begins by then.
    assert swap_in_tick(WEIGHT, W_GAP, 1.0) == 1
    # At 0.1 GB/s (3000 ns) no tick of this iteration is early enough: the first, t0.
    assert swap_in_tick(WEIGHT, W_GAP, 0.1) == 0
    # With B's (1000 ns, needed at t5) too: B cannot be issued before t2, after its swap-out's
    # op, and W, needed after B, keeps its place behind it in the stream.
    assert swap_in_ticks(WEIGHT, [W_GAP, B_GAP], 0.1) == [2, 2]


# A and B (100 B each) are used at t2 and t9, C (300 B) makes the peak between them. At 1 GB/s
# each copy takes 100 ns; ticks start at 0 0 0 10 210 210 220 220 220 320 420 420 ns.
SERIAL = build(
    [
        "a A 100",
        "a B 100",
        "o 10 A B",
        "o 200",
        "a C 300",
        "o 10 C",
        "f C",
        "o 100",
        "o 100",
        "o 10 A B",
        "f A",
        "f B",
    ]
)


def test_swap_ins_needed_together_are_laid_back_to_back() -> None:
    a, b = candidates(SERIAL, 0)
    # Alone, each copy hides under op t8 (220..320 ns); on the one stream the second would end
    # at 420 + 100. Laid out backwards from t9 (420 ns): B 320..420 (t8), A 220..320 (t7).
    assert swap_in_tick(SERIAL, a, 1.0) == swap_in_tick(SERIAL, b, 1.0) == 8
    assert swap_in_ticks(SERIAL, [a, b], 1.0) == [7, 8]
    plan = autoswap(SERIAL, 300, 1.0, 1.0)
    assert plan == SwapPlan(
        (Swap(0, Tick(2), Tick(9), Tick(7)), Swap(1, Tick(2), Tick(9), Tick(8)))
    )
    r = simulate(SERIAL, plan, 300, 1.0, 1.0)
    assert (r.feasible, r.peak_bytes, r.stall_ns, r.iteration_ns) == (True, 300, 0, 430)
    validate_swaps(SERIAL, plan, r, 300, 1.0)
    late = SwapPlan(tuple(replace(s, in_at=Tick(8)) for s in plan.swaps))
    assert simulate(SERIAL, late, 300, 1.0, 1.0).stall_ns == 100


def test_bayesian_optimization_finds_the_weight_across_the_boundary() -> None:
    tuned = tune(WEIGHT, 300, 3.0, 3.0, trials=4)
    assert tuned.plan == SwapPlan((W_SWAP,))
    assert (tuned.result.feasible, tuned.result.overhead) == (True, 0.0)
    assert autoswap_bo(WEIGHT, 300, 3.0, 3.0, trials=2) == SwapPlan((W_SWAP,))


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


@pytest.mark.skipif(not RESNET.exists(), reason=f"no trace at {RESNET}")
def test_where_the_iv_e_layout_cannot_run_the_swap_ins_are_issued_one_op_ahead() -> None:
    # On resnet50 at 0.8 of the peak, 50 GB/s, the AOA picks laid out back to back by IV-E
    # issue a swap-in so early that it waits for room ahead of one needed sooner: stuck.
    events = read_trace_csv(RESNET)
    it = extract(events, events.marks())
    limit = int(0.8 * no_limit(it).peak_bytes)
    got = autoswap(it, limit, 50.0, 50.0, score="aoa")
    assert got.swaps and all(s.in_at is None for s in got.swaps)
    r = simulate(it, got, limit, 50.0, 50.0)
    assert r.feasible
    validate_swaps(it, got, r, limit, 50.0)
    cands = {(c.block, c.out_after): c for c in candidates(it, 0)}
    picked = [cands[(s.block, s.out_after)] for s in got.swaps if (s.block, s.out_after) in cands]
    if len(picked) == len(got.swaps):  # all picked in the first round: the IV-E layout is stuck
        at = swap_in_ticks(it, picked, 50.0)
        timed = SwapPlan(tuple(replace(s, in_at=t) for s, t in zip(got.swaps, at, strict=True)))
        assert not simulate(it, timed, limit, 50.0, 50.0).feasible
