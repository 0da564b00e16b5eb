"""planner/bound: the step-time lower bound against every plan of tiny iterations (swaps with
every `in_at`, recomputations, every disjoint combination), equal to the optimum where it must
be, and below the plans the policies make on a real trace."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from tidalcore.units import Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.autoswap import load
from tidalplan.bound import step_bound
from tidalplan.learn import extract
from tidalplan.model import Iteration, Recompute, Swap, SwapPlan
from tidalplan.policies import plans
from tidalplan.simulate import simulate

from ..conftest import shared_file
from .iterations import build

Away = Swap | Recompute


def _singles(it: Iteration, block: int, persistent: bool, recompute: bool) -> list[Away]:
    """Every swap (each `in_at`) and recomputation of one block a plan may hold."""
    ops = [o.tick for o in it.ops]
    pid = it.persistent[block][0] if persistent else it.blocks[block].id
    touched = [a.tick for a in it.accesses if a.block == pid]
    writes = [a.tick for a in it.accesses if a.block == pid and a.write]
    out: list[Away] = []
    for a, c in itertools.product(ops, ops):
        if persistent:
            away = [t for t in touched if ((a < t < c) if a < c else (t > a or t < c))]
        else:
            b = it.blocks[block]
            if not b.start < a < c < b.end:
                continue
            away = [t for t in touched if a < t < c]
        if away:
            continue
        first = a + 1 if a < c else 0
        out += [Swap(block, a, c, Tick(at), persistent) for at in range(first, c + 1)]
        if recompute and not persistent and any(w <= a for w in writes):
            out.append(Recompute(block, a, c))
    return out


def _span(x: Away) -> tuple[int, int]:
    return (x.out_after, x.in_before) if isinstance(x, Swap) else (x.drop_after, x.before)


def _disjoint(chosen: tuple[Away, ...]) -> bool:
    spans = [_span(x) for x in chosen]
    crossing = [s for s in spans if s[1] <= s[0]]
    inside = sorted(s for s in spans if s[1] > s[0])
    if len(crossing) > 1 or any(b[0] < a[1] for a, b in itertools.pairwise(inside)):
        return False
    return all(lo >= c[1] and hi <= c[0] for c in crossing for lo, hi in inside)


def _per_block(
    it: Iteration, block: int, persistent: bool, recompute: bool
) -> list[tuple[Away, ...]]:
    singles = _singles(it, block, persistent, recompute)
    out: list[tuple[Away, ...]] = [()]
    for k in (1, 2):
        out += [c for c in itertools.combinations(singles, k) if _disjoint(c)]
    return out


def _plans(it: Iteration, recompute: bool) -> Iterator[SwapPlan]:
    options = [_per_block(it, i, False, recompute) for i in range(len(it.blocks))]
    options += [_per_block(it, j, True, False) for j in range(len(it.persistent))]
    for combo in itertools.product(*options):
        every = [x for part in combo for x in part]
        yield SwapPlan(
            tuple(x for x in every if isinstance(x, Swap)),
            tuple(x for x in every if isinstance(x, Recompute)),
        )


def _best(it: Iteration, limit: int, gbps: float, recompute: bool) -> tuple[int | None, int]:
    """The shortest feasible `iteration_ns` over every plan (None: none is feasible), and how
    many plans `simulate` ran."""
    best: int | None = None
    count = 0
    for plan in _plans(it, recompute):
        try:
            r = simulate(it, plan, limit, gbps, gbps)
        except ValueError:  # a rebuild whose writer reads a block that is away
            continue
        count += 1
        if r.feasible and (best is None or r.iteration_ns < best):
            best = r.iteration_ns
    return best, count


# A is written by op t1 and read at t5; B comes and goes between with no compute to hide a copy.
WRITTEN = build(["a A 100", "o 10 >A", "a B 100", "o 0 B", "f B", "o 20 A", "f A"])
READ_ONLY = build(["a A 100", "o 10 A", "a B 100", "o 0 B", "f B", "o 20 A", "f A"])


def test_no_excess_is_the_compute_time() -> None:
    b = step_bound(WRITTEN, 200, 1.0, 1.0)
    assert (b.ns, b.compute_ns, b.program_ns, b.excess_bytes) == (30, 30, 0, 0)
    assert _best(WRITTEN, 200, 1.0, True)[0] == 30


def test_a_copy_with_nothing_to_hide_behind_is_the_optimum() -> None:
    # A must be away at t2..t4: out after op t1 (10 + 100 ns), B's malloc waits for it, op t3
    # takes nothing, A comes back (100 ns) before op t5 (20 ns): 230 ns, and no plan is faster.
    b = step_bound(READ_ONLY, 100, 1.0, 1.0)
    assert b.ns == 230 and b.excess_bytes == 100
    assert _best(READ_ONLY, 100, 1.0, True)[0] == 230
    # Half the excess: still one whole block to move, which the cover's coefficients know.
    assert step_bound(READ_ONLY, 150, 1.0, 1.0).ns == 230
    assert _best(READ_ONLY, 150, 1.0, True)[0] == 230


def test_recomputing_is_the_optimum_when_its_writer_is_cheap() -> None:
    # Dropping A after t1 and running op t1 again before t5 costs 10 ns: 40 ns in all.
    assert step_bound(WRITTEN, 100, 1.0, 1.0).ns == 40
    assert _best(WRITTEN, 100, 1.0, True)[0] == 40
    # Swaps alone cannot do better than the copies.
    assert step_bound(WRITTEN, 100, 1.0, 1.0, recompute=False).ns == 230
    assert _best(WRITTEN, 100, 1.0, False)[0] == 230


def test_none_when_an_op_or_a_tick_cannot_fit() -> None:
    b = step_bound(WRITTEN, 99, 1.0, 1.0)
    assert b.ns is None and b.compute_ns == 30 and "op" in b.reason
    assert _best(WRITTEN, 99, 1.0, True)[0] is None
    # Each op touches 100 bytes, but at B's malloc (t1) no op has run since A's: A cannot be away.
    both = build(["a A 100", "a B 100", "o 5 >A", "o 5 >B", "f A", "f B"])
    b = step_bound(both, 150, 1.0, 1.0)
    assert b.ns is None and "tick 1" in b.reason
    assert _best(both, 150, 1.0, True)[0] is None


def test_a_weight_away_since_the_start_goes_out_again_after_its_access() -> None:
    # W (read at t5 only) must be away while X lives: it comes in after X's free (100 ns),
    # and after op t5 it goes out again (100 ns) within the iteration, after the 30 ns of ops
    # from t2 to t5: at least 10 + 30 + 100 ns. Its only plan takes 230 ns.
    it = build(["a X 100", "o 10 >X", "o 10 X", "f X", "o 10", "o 10 W", "o 1"], {"W": 100})
    b = step_bound(it, 100, 1.0, 1.0, recompute=False)
    assert b.ns == 140
    assert _best(it, 100, 1.0, False)[0] == 230


CASES = [
    # (steps, persistent, limits, gbps)
    (["a A 100", "o 10 >A", "a B 100", "o 0 B", "f B", "o 20 A", "f A"], {}, (100, 150), 1.0),
    (
        ["a A 100", "o 40 >A", "a B 60", "o 30 >B", "o 20 B", "f B", "o 20 A", "f A"],
        {},
        (100, 130, 160),
        2.0,
    ),
    (["o 10 W", "a X 100", "o 30 >X", "o 5 X", "f X"], {"W": 100}, (100, 150), 1.0),
    (["a X 100", "o 10 >X", "o 10 X", "f X", "o 10", "o 10 W", "o 1"], {"W": 100}, (100, 150), 1.0),
    (
        ["o 10 W", "a X 50", "o 20 >X", "o 10", "o 5 X", "f X", "o 5 W"],
        {"W": 80},
        (80, 100, 120),
        2.0,
    ),
    (
        [
            "a A 60",
            "o 10 >A",
            "a B 40",
            "o 20 A >B",
            "a C 50",
            "o 5 C",
            "f C",
            "o 10 B A",
            "f B",
            "f A",
        ],
        {},
        (100, 120, 140),
        1.0,
    ),
]


@pytest.mark.parametrize(("steps", "persistent", "limits", "gbps"), CASES)
def test_bound_is_below_every_feasible_plan(
    steps: list[str], persistent: dict[str, int], limits: tuple[int, ...], gbps: float
) -> None:
    it = build(steps, persistent)
    feasible = 0
    for limit in limits:
        for recompute in (False, True):
            best, count = _best(it, limit, gbps, recompute)
            assert count > 1
            feasible += best is not None
            b = step_bound(it, limit, gbps, gbps, recompute=recompute)
            if b.ns is None:
                assert best is None, (limit, recompute)
            elif best is not None:
                assert b.compute_ns <= b.ns <= best, (limit, recompute, b, best)
            if recompute:  # every swap plan is a plan: the bound with recomputation is lower
                swaps_only = step_bound(it, limit, gbps, gbps, recompute=False)
                assert b.ns is None or (swaps_only.ns is not None and b.ns <= swaps_only.ns)
    assert feasible


def test_compute_scale_rounds_as_simulate_does() -> None:
    it = build(["a A 100", "o 3 A", "a B 100", "o 1 B", "f B", "o 5 A", "f A"])
    b = step_bound(it, 100, 1.0, 1.0, compute_scale=2.5)
    # round(7.5) = 8, round(2.5) = 2, round(12.5) = 12 (to even), as `simulate` rounds.
    assert b.compute_ns == 22
    best, _ = _best_scaled(it, 100, 2.5)
    assert b.ns is not None and b.ns <= best


def _best_scaled(it: Iteration, limit: int, scale: float) -> tuple[int, int]:
    times = []
    for plan in _plans(it, False):
        r = simulate(it, plan, limit, 1.0, 1.0, scale)
        if r.feasible:
            times.append(r.iteration_ns)
    return min(times), len(times)


def test_bound_is_below_the_policies_on_a_real_trace() -> None:
    events = read_trace_csv(shared_file("traces/models/vgg16.b32.trace.csv"))
    it = extract(events, events.marks())
    peak = int(load(it).max())
    for fraction, gbps in ((0.7, 12.0), (0.7, 50.0)):
        limit = int(fraction * peak)
        both = step_bound(it, limit, gbps, gbps)
        swaps = step_bound(it, limit, gbps, gbps, recompute=False)
        assert both.ns is not None and swaps.ns is not None
        assert both.compute_ns <= both.ns <= swaps.ns
        feasible = 0
        for name, plan in plans(it, ["autoswap-swdoa", "vdnn-dyn"], limit, gbps, gbps).items():
            r = simulate(it, plan, limit, gbps, gbps)
            if r.feasible:
                feasible += 1
                assert swaps.ns <= r.iteration_ns, name
        assert feasible
    # Copies that cannot hide behind the compute: the swap-only bound is well above it.
    assert swaps.ns is not None and swaps.ns > both.compute_ns
