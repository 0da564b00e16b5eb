"""planner/search: keep, swap or recompute each gap for the shortest simulated step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tidalcore.units import Tick
from tidalplan.autoswap import load, load_min
from tidalplan.gap_cover import _Timeline
from tidalplan.model import Iteration, Recompute, Swap, SwapPlan
from tidalplan.policies import plans
from tidalplan.search import _Candidates, _Choice, _longest, _Search, cover, search
from tidalplan.simulate import no_limit, simulate
from tidalplan.validate import validate_swaps

from .iterations import build

TRACE = Path(__file__).resolve().parents[3] / "shared/traces/models/vgg16.b32.trace.csv"


def _checked(it: Iteration, limit: int, gbps: float) -> tuple[int, SwapPlan]:
    plan = search(it, limit, gbps, gbps)
    r = simulate(it, plan, limit, gbps, gbps)
    assert r.feasible
    validate_swaps(it, plan, r, limit, gbps)
    return r.iteration_ns, plan


def test_a_copy_hidden_behind_compute_is_a_swap() -> None:
    # A's writer is slow (5000 ns); compute on both sides of B's life hides the copies of
    # 1000 bytes at 1 GB/s (1000 ns each). The peak (A and B) is 1000 bytes over the limit.
    it = build(
        [
            "a A 1000",  # 0
            "o slow 5000 >A",  # 1
            "o 10000",  # 2
            "a B 1000",  # 3
            "o 10000 >B",  # 4
            "f B",  # 5
            "o 10000",  # 6
            "o 1000 A",  # 7
            "f A",  # 8
        ]
    )
    step, plan = _checked(it, 1000, 1.0)
    assert plan.recomputes == () and plan.swaps == (Swap(0, Tick(1), Tick(7), plan.swaps[0].in_at),)
    assert step == no_limit(it).baseline_ns == 36_000


def test_nothing_is_searched_past_the_deadline() -> None:
    """The daemon bounds a whole plan: a search whose deadline has passed judges nothing and
    returns no swaps (which do not fit), where one without a deadline finds the swap."""
    it = build(
        ["a A 1000", "o 5000 >A", "o 10000", "a B 1000", "o 10000 >B", "f B", "o 1000 A", "f A"]
    )
    seen: list[float] = []
    assert search(it, 1000, 1.0, 1.0, progress=seen.append).swaps
    seen.clear()
    cut = search(it, 1000, 1.0, 1.0, progress=seen.append, deadline=time.monotonic() - 1.0)
    assert cut == SwapPlan() and seen == []  # not one simulation
    assert not simulate(it, cut, 1000, 1.0, 1.0).feasible


def test_a_gap_too_short_for_the_copies_is_recomputed() -> None:
    # The same shape with a cheap writer and a short gap at 0.01 GB/s: the copies would take
    # 100,000 ns each way, the writer runs again in 10 ns.
    it = build(
        [
            "a X 10",  # 0
            "o load 100 >X",  # 1
            "a A 1000",  # 2
            "o cheap 10 X >A",  # 3
            "a B 1000",  # 4
            "o 100 >B",  # 5
            "f B",  # 6
            "o 100 A X",  # 7
            "f A",  # 8
            "f X",  # 9
        ]
    )
    step, plan = _checked(it, 1010, 0.01)
    assert plan.swaps == () and plan.recomputes == (Recompute(1, Tick(3), Tick(7)),)
    assert step == no_limit(it).baseline_ns + 10


def test_a_persistent_weight_leaves_across_the_iteration_boundary() -> None:
    # W (1000 bytes) is read by the middle op only; the peak, C, is at the end of the
    # iteration: W away from the end of op 1 round to op 1 of the next iteration is the only
    # cover, and the copies fit in the 30,000 ns around it at 1 GB/s.
    it = build(
        [
            "o 10000",  # 0
            "o mid 100 W",  # 1
            "o 10000",  # 2
            "a C 1000",  # 3
            "o 10000 >C",  # 4
            "f C",  # 5
        ],
        persistent={"W": 1000},
    )
    step, plan = _checked(it, 1000, 1.0)
    assert plan.recomputes == ()
    assert [(s.block, s.out_after, s.in_before, s.persistent) for s in plan.swaps] == [
        (0, 1, 1, True)
    ]
    assert step == no_limit(it).baseline_ns


def test_below_load_min_a_block_is_swapped_twice() -> None:
    # X is only read (no writer: it cannot be recomputed) at ops 1, 7 and 13; the peaks P and
    # Q lie in its two gaps. AutoSwap's candidates span one peak only, so its load_min keeps X
    # over the other; with X away over both gaps the iteration fits 1000 bytes lower, and the
    # 2000 ns ops around P and Q hide every copy.
    it = build(
        [
            "a X 1000",  # 0
            "o 1000 X",  # 1
            "o 2000",  # 2
            "a P 1000",  # 3
            "o 10000 >P",  # 4
            "f P",  # 5
            "o 2000",  # 6
            "o 1000 X",  # 7
            "o 2000",  # 8
            "a Q 1000",  # 9
            "o 10000 >Q",  # 10
            "f Q",  # 11
            "o 2000",  # 12
            "o 1000 X",  # 13
            "f X",  # 14
        ]
    )
    assert int(load(it).max()) == 2000 and load_min(it) == 2000
    step, plan = _checked(it, 1000, 1.0)
    assert sorted((s.block, s.out_after, s.in_before) for s in plan.swaps) == [
        (0, 1, 7),
        (0, 7, 13),
    ]
    assert step == no_limit(it).baseline_ns == 31_000


def _searcher(it: Iteration, limit: int, gbps: float, depths: tuple[int, ...] = ()) -> _Search:
    return _Search(it, limit, gbps, gbps, _Candidates(it, gbps, gbps, depths), 64, None)


def _column(s: _Search, block: int, a: int, c: int) -> int:
    return next(k for k, g in enumerate(s.cands.gaps) if (g.block, g.a, g.c) == (block, a, c))


def _best(s: _Search) -> tuple[bool, int, SwapPlan]:
    _, choice, result = s.current()
    return result.feasible, result.iteration_ns, choice.plan(s.cands)


# A (slow to write) and B over the limit at B's op; A's copies hide behind the 10,000 ns ops.
HIDDEN = [
    "a A 1000",  # 0
    "o slow 5000 >A",  # 1
    "o 10000",  # 2
    "a B 1000",  # 3
    "o 10000 >B",  # 4
    "f B",  # 5
    "o 10000",  # 6
    "o 1000 A",  # 7
    "f A",  # 8
]


def test_repair_covers_the_tick_where_an_infeasible_plan_got_stuck() -> None:
    # With nothing away, B's malloc (tick 3) never fits; A's gap is the one that spans it.
    it = build(HIDDEN)
    s = _searcher(it, 1000, 1.0)
    s.judge(_Choice((), ()))
    assert _best(s)[0] is False
    s.repair()
    feasible, step, plan = _best(s)
    assert feasible and step == 36_000
    assert [(x.block, x.out_after, x.in_before) for x in plan.swaps] == [(0, 1, 7)]


def test_drop_leaves_out_a_swap_no_tick_needs() -> None:
    # X away over both of its gaps; only the first holds the peak P: the second swap goes,
    # the step stays the same (each swap makes the op after it wait for the copies, 1000 ns
    # each: op 7's swap-in hides behind op 6) and half the bytes move.
    it = build(
        [
            "a X 1000",  # 0
            "o 1000 X",  # 1
            "a P 1000",  # 2
            "o 10000 >P",  # 3
            "f P",  # 4
            "o 1000 X",  # 5
            "o 10000",  # 6
            "o 1000 X",  # 7
            "f X",  # 8
        ]
    )
    s = _searcher(it, 1000, 1.0)
    s.judge(_Choice(((_column(s, 0, 1, 5), None), (_column(s, 0, 5, 7), None)), ()))
    assert _best(s)[1] == 25_000
    s.drop()
    feasible, step, plan = _best(s)
    assert feasible and step == 25_000
    assert [(x.block, x.out_after, x.in_before) for x in plan.swaps] == [(0, 1, 5)]
    assert s.current()[2].out_bytes == 1000


def test_exchange_turns_a_recomputation_back_into_a_swap() -> None:
    # Rebuilding A costs its writer's 5000 ns; its swap hides.
    it = build(HIDDEN)
    s = _searcher(it, 1000, 1.0, (0,))
    s.judge(_Choice((), (0,)))
    assert _best(s)[1] == 41_000
    s.exchange()
    feasible, step, plan = _best(s)
    assert feasible and step == 36_000 and plan.recomputes == ()
    assert [(x.block, x.out_after, x.in_before) for x in plan.swaps] == [(0, 1, 7)]


def test_shift_exchanges_a_swap_for_one_whose_copies_hide() -> None:
    # A and C both span B's malloc; C's gap holds 10 ns of compute, A's 10,000 ns each side.
    it = build(
        [
            "a A 1000",  # 0
            "o 5000 >A",  # 1
            "o 10000",  # 2
            "a C 1000",  # 3
            "o 10 >C",  # 4
            "a B 1000",  # 5
            "o 10 >B",  # 6
            "f B",  # 7
            "o 10 C",  # 8
            "f C",  # 9
            "o 10000",  # 10
            "o 10 A",  # 11
            "f A",  # 12
        ]
    )
    s = _searcher(it, 2000, 1.0)
    s.judge(_Choice(((_column(s, 1, 4, 8), None),), ()))
    assert _best(s)[1] > no_limit(it).baseline_ns
    s.shift()
    feasible, step, plan = _best(s)
    assert feasible and step == no_limit(it).baseline_ns == 25_040
    assert [(x.block, x.out_after, x.in_before) for x in plan.swaps] == [(0, 1, 11)]


def test_nudge_issues_a_late_swap_in_one_op_earlier() -> None:
    # Issued at op 7 (500 ns) A's 1000 ns copy makes op 8 wait 500 ns; at op 6 it hides.
    it = build(
        [
            "a A 1000",  # 0
            "o 5000 >A",  # 1
            "o 10000",  # 2
            "a B 1000",  # 3
            "o 10000 >B",  # 4
            "f B",  # 5
            "o 10000",  # 6
            "o 500",  # 7
            "o 1000 A",  # 8
            "f A",  # 9
        ]
    )
    s = _searcher(it, 1000, 1.0)
    k = _column(s, 0, 1, 8)
    s.judge(_Choice(((k, 7),), ()))
    assert _best(s)[1] == no_limit(it).baseline_ns + 500
    s.nudge()
    feasible, step, plan = _best(s)
    assert feasible and step == no_limit(it).baseline_ns == 36_500
    assert plan.swaps == (Swap(0, Tick(1), Tick(8), Tick(6)),)


def test_the_plain_start_holds_each_block_away_over_its_longest_gap() -> None:
    it = build(
        [
            "a X 1000",  # 0
            "o 10 >X",  # 1
            "o 10 X",  # 2
            "a Y 1000",  # 3
            "o 10 >Y",  # 4
            "o 10",  # 5
            "o 10 X Y",  # 6
            "o 10 Y",  # 7
            "f Y",  # 8
            "f X",  # 9
        ]
    )
    cands = _Candidates(it, 1.0, 1.0, ())
    plan = _longest(cands).plan(cands)
    assert [(x.block, x.out_after, x.in_before) for x in plan.swaps] == [(0, 2, 6), (1, 4, 6)]


@pytest.fixture(scope="module")
def vgg() -> Iteration:
    if not TRACE.is_file():
        pytest.skip(f"no trace at {TRACE}")
    from tidaloffline.formats import read_trace_csv
    from tidalplan.learn import extract

    events = read_trace_csv(TRACE)
    return extract(events, events.marks())


@pytest.mark.parametrize("fraction", [0.9, 0.7])
def test_on_a_model_trace_no_slower_than_the_baselines(vgg: Iteration, fraction: float) -> None:
    limit = int(fraction * int(load(vgg).max()))
    step, _ = _checked(vgg, limit, 25.0)
    for name, plan in plans(vgg, ["autoswap-swdoa", "vdnn-dyn"], limit, 25.0, 25.0).items():
        r = simulate(vgg, plan, limit, 25.0, 25.0)
        assert not r.feasible or step <= r.iteration_ns, name


def test_eager_issues_a_swap_in_once_the_peak_has_passed() -> None:
    # A (1000 bytes, 1000 ns each way) is out for B's op; 600 ns of compute lie between B's
    # free and A's use, less than the copy. Issued by default at op 6, op 7 waits 700 ns;
    # as late as the copy allows it would start before B's malloc and hold its bytes. Issued
    # at B's free (tick 4) the copy starts there and op 7 waits 400 ns.
    it = build(
        [
            "a A 1000",  # 0
            "o 100 >A",  # 1
            "a B 1000",  # 2
            "o 100 >B",  # 3
            "f B",  # 4
            "o 300",  # 5
            "o 300",  # 6
            "o 100 A",  # 7
            "f A",  # 8
        ]
    )
    s = _searcher(it, 1000, 1.0)
    k = _column(s, 0, 1, 7)
    s.judge(_Choice(((k, None),), ()))
    assert _best(s)[1] == 2600
    s.judge(s.eager(s.current()[1]))
    feasible, step, plan = _best(s)
    assert feasible and step == 2300
    assert plan.swaps == (Swap(0, Tick(1), Tick(7), Tick(4)),)


# A's and C's gaps both span B's malloc; A's holds far more compute.
SPANS = [
    "a A 1000",  # 0
    "o 5000 >A",  # 1
    "o 10000",  # 2
    "a C 1100",  # 3
    "o 10 >C",  # 4
    "a B 1000",  # 5
    "o 10 >B",  # 6
    "f B",  # 7
    "o 10 C",  # 8
    "f C",  # 9
    "o 10000",  # 10
    "o 10 A",  # 11
    "f A",  # 12
]


def test_the_span_weighted_cover_prefers_the_longer_gap() -> None:
    # A's and C's gaps both span B's malloc; C's larger copies cost less a byte, so the plain
    # cover takes C, whose gap holds 30 ns of compute; A's holds 10,030.
    it = build(SPANS)
    cands = _Candidates(it, 1.0, 1.0, ())
    tl = _Timeline(it, 2100)
    plain = cover(cands, tl, 1.0, False, False)
    made = cover(cands, tl, 1.0, False, False, by_span=True)
    assert plain is not None and made is not None and made.redos == ()
    assert [(cands.gaps[k].block, cands.gaps[k].a, cands.gaps[k].c) for k, _ in plain.swaps] == [
        (1, 4, 8)
    ]
    assert [(cands.gaps[k].block, cands.gaps[k].a, cands.gaps[k].c) for k, _ in made.swaps] == [
        (0, 1, 11)
    ]


def test_a_banned_column_is_left_out_of_the_cover_where_another_holds_the_bytes() -> None:
    # The iteration of the span test: the plain cover takes C's gap; with it banned, A's.
    it = build(SPANS)
    cands = _Candidates(it, 1.0, 1.0, ())
    tl = _Timeline(it, 2100)
    c = next(k for k, g in enumerate(cands.gaps) if (g.block, g.a, g.c) == (1, 4, 8))
    made = cover(cands, tl, 1.0, False, False, banned=(c,))
    assert made is not None
    assert [(cands.gaps[k].block, cands.gaps[k].a, cands.gaps[k].c) for k, _ in made.swaps] == [
        (0, 1, 11)
    ]
    # Banned, a column is still taken where nothing else holds the bytes: B over its op.
    tight = _Timeline(it, 1100)
    alone = cover(cands, tight, 1.0, False, False, banned=(c,))
    assert alone is not None
    assert (1, 4, 8) in [
        (cands.gaps[k].block, cands.gaps[k].a, cands.gaps[k].c) for k, _ in alone.swaps
    ]


def test_with_swaps_alone_the_banned_starts_beat_autoswap_on_vgg16_in_pages(
    vgg: Iteration, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vgg16 at 0.8 of its peak, 50 GB/s, in pages of 2 MiB wasting up to 12.5%: every start's
    moves end with the 392 MiB weight swapped inside the iteration (36.70 ms); from the cover
    without it the search finds 34.35 ms, under AutoSwap-BO's 35.70 on the same iteration."""
    from tidalplan import paged
    from tidalplan import search as search_module
    from tidalplan.learn import live_bytes

    peak = int(live_bytes(vgg).max()) + sum(size for _, size in vgg.persistent)
    limit = int(peak * 0.8)
    pit = paged.paged(vgg, paged.layout(vgg, 2 << 20, 0.125))
    plan = search(pit, limit, 50.0, 50.0, recompute=False)
    r = simulate(pit, plan, limit, 50.0, 50.0)
    assert r.feasible
    validate_swaps(pit, plan, r, limit, 50.0)
    (bo,) = plans(pit, ["autoswap-bo"], limit, 50.0, 50.0).values()
    assert r.iteration_ns < simulate(pit, bo, limit, 50.0, 50.0).iteration_ns
    monkeypatch.setattr(search_module, "_BANS", 0)
    without = search(pit, limit, 50.0, 50.0, recompute=False)
    assert r.iteration_ns < simulate(pit, without, limit, 50.0, 50.0).iteration_ns
