"""Placement: the lower bound, SmartPool, each rule × ordering, and the solver's options.

Small instances are written by hand; their offsets are worked out in the comments.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tidalcore.units import Bytes, Tick
from tidaloffline.formats import read_problem_csv
from tidalplan import placement
from tidalplan.model import Buffer, Problem
from tidalplan.placement import (
    ORDERINGS,
    RULES,
    greedy,
    lower_bound,
    smartpool,
    solve,
)
from tidalplan.validate import validate

from ..conftest import shared_file

Search = Callable[..., tuple[str, tuple[int, ...] | None]]


def problem(*rows: tuple[int, int, int], alignment: int = 1) -> Problem:
    """Buffers 0, 1, ... from (lower, upper, size)."""
    return Problem(
        tuple(Buffer(i, Tick(lo), Tick(up), Bytes(s)) for i, (lo, up, s) in enumerate(rows)),
        alignment,
    )


# Six buffers over ticks 0..6; live bytes per tick: 5 6 5 7 6 4, so the bound is 7 (tick 3).
#   b0 [0,2) 4   b1 [1,5) 2   b2 [2,6) 3   b3 [4,6) 1   b4 [0,1) 1   b5 [3,4) 2
SIX = problem((0, 2, 4), (1, 5, 2), (2, 6, 3), (4, 6, 1), (0, 1, 1), (3, 4, 2))

# Seven buffers: bound 15, and a placement at 15 exists; most greedy runs reach 16 or 18.
SEVEN = ((6, 9, 6), (0, 6, 3), (3, 4, 6), (5, 8, 5), (2, 5, 5), (4, 6, 5), (4, 9, 2))
# Seven more: bound 10, reached; canonical/start and canonical/length reach 12.
SEVEN_B = ((0, 7, 3), (7, 9, 6), (2, 4, 1), (4, 6, 2), (2, 5, 4), (5, 8, 4), (1, 7, 1))


# -- lower bound --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "alignment", "bound"),
    [
        ((), 1, 0),
        (((0, 1, 7),), 1, 7),
        (((0, 2, 4), (2, 4, 4)), 1, 4),  # touching lifetimes do not add up
        (((0, 3, 4), (1, 4, 6), (2, 5, 1)), 1, 11),  # all three at tick 2
        (((0, 3, 4), (1, 4, 6), (3, 5, 1)), 1, 10),  # the third starts as the first ends
        (((0, 2, 100), (1, 3, 300)), 256, 768),  # 256 + 512
        (((0, 2, 256), (1, 3, 257)), 256, 768),
        (((0, 2, 4), (1, 5, 2), (2, 6, 3), (4, 6, 1), (0, 1, 1), (3, 4, 2)), 1, 7),  # SIX
    ],
)
def test_lower_bound_exact(
    rows: tuple[tuple[int, int, int], ...], alignment: int, bound: int
) -> None:
    assert lower_bound(problem(*rows, alignment=alignment)) == bound


def test_lower_bound_refuses_alignment_below_one() -> None:
    with pytest.raises(ValueError, match="alignment must be at least 1, got 0"):
        lower_bound(problem((0, 1, 1), alignment=0))


# -- SmartPool ----------------------------------------------------------------------------------


def test_smartpool_exact_offsets() -> None:
    # Decreasing size, earlier start first: b0(4) b2(3) b1(2) b5(2) b4(1) b3(1).
    # b0 -> 0. b2 [2,6) meets nothing placed (b0 ends at 2) -> 0. b1 meets b0 [0,4) and
    # b2 [0,3), merged [0,4): no hole -> 4. b5 [3,4) meets b2 [0,3) and b1 [4,6): the hole
    # [3,4) is too small -> on top, 6. b4 meets b0 -> 4. b3 [4,6) meets b2 and b1: the hole
    # [3,4) holds it -> 3.
    placed = smartpool(SIX)
    assert placed.offsets == (0, 4, 0, 3, 4, 6)
    assert (placed.height, placed.solver, placed.optimal) == (8, "smartpool", False)


def test_smartpool_takes_the_smallest_hole_not_the_lowest() -> None:
    # b4 [1,3) 5 -> 0; b3 [2,6) 4 -> 5; b2 [2,4) 3 -> 9; b1 [2,6) 2 -> 12. b0 [5,6) 1 meets
    # b3 [5,9) and b1 [12,14): holes [0,5) (5 bytes) and [9,12) (3 bytes); best fit is 9
    # where first fit would say 0.
    p = problem((5, 6, 1), (2, 6, 2), (2, 4, 3), (2, 6, 4), (1, 3, 5))
    assert smartpool(p).offsets == (9, 12, 9, 5, 0)
    assert greedy(p, "fit", "size").offsets == (0, 12, 9, 5, 0)  # same order, lowest fit


def test_smartpool_empty_and_aligned() -> None:
    assert smartpool(problem()).offsets == ()
    assert smartpool(problem()).height == 0
    placed = smartpool(problem((0, 2, 100), (1, 3, 300), alignment=256))
    assert placed.offsets == (512, 0)  # 300 -> 512 bytes first, at 0
    assert placed.height == 768


# -- each rule with each ordering ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "ordering", "offsets", "height"),
    [
        # length: b2 b1 b0 b3 b5 b4. Canonical: b2 at 0; lowest now b0, b4 (0): b0 -> 0; then
        # b3, b5 (3): b3 -> 3, b5 -> 3 (they touch); b4 -> 4; b1 on top of all, 5.
        ("canonical", "length", (0, 5, 0, 3, 4, 3), 7),
        # Fit: b2 -> 0; b1 above it, 3; b0 meets b1 [3,5), the gap [0,3) is short -> 5;
        # b3 and b5 meet b2 [0,3) and b1 [3,5) -> 5; b4 meets b0 [5,9) -> 0.
        ("fit", "length", (5, 3, 0, 5, 0, 5), 9),
        ("canonical", "size", (0, 5, 0, 3, 4, 3), 7),
        ("fit", "size", (0, 4, 0, 3, 4, 6), 8),  # SmartPool's order; lowest fit = best fit here
        ("canonical", "area", (0, 5, 0, 3, 4, 3), 7),
        ("fit", "area", (0, 4, 0, 3, 4, 6), 8),
        ("canonical", "start", (0, 5, 0, 3, 4, 3), 7),
        ("fit", "start", (0, 4, 0, 3, 4, 6), 8),
        # conflicts: b1 (meets 4) b2 (3) b0 b5 b3 (2, larger first) b4 (1). Canonical: b1 -> 0;
        # lowest now b4 alone (0) -> 0; then b2 -> 2 (rank before b0), b0 -> 2 (touches b2);
        # b5 and b3 on b2's top, 5. Fit: b1 -> 0, b2 -> 2, b0 -> 2, b5 and b3 -> 5, b4 under
        # b0 -> 0: the same.
        ("canonical", "conflicts", (2, 0, 2, 5, 0, 5), 7),
        ("fit", "conflicts", (2, 0, 2, 5, 0, 5), 7),
        # contention (peak live bytes over the lifetime): b2 b1 b5 (7), b0 b3 (6), b4 (5).
        ("canonical", "contention", (0, 5, 0, 3, 4, 3), 7),
        ("fit", "contention", (5, 3, 0, 5, 0, 5), 9),
    ],
)
def test_greedy_exact_offsets(
    rule: str, ordering: str, offsets: tuple[int, ...], height: int
) -> None:
    placed = greedy(SIX, rule, ordering)
    assert placed.offsets == offsets
    assert placed.height == height
    assert placed.solver == f"{rule}/{ordering}"
    assert placed.optimal is (height == 7)  # reaching the bound proves it
    validate(SIX, placed)


def test_every_rule_and_ordering_is_listed_above() -> None:
    assert set(RULES) == {"canonical", "fit"}
    assert set(ORDERINGS) == {"length", "size", "area", "start", "conflicts", "contention"}


@pytest.mark.parametrize(("rule", "ordering"), list(itertools.product(RULES, ORDERINGS)))
def test_touching_lifetimes_share_bytes(rule: str, ordering: str) -> None:
    p = problem((0, 2, 5), (2, 4, 5), (4, 6, 5))
    assert greedy(p, rule, ordering).offsets == (0, 0, 0)
    assert smartpool(p).offsets == (0, 0, 0)


@pytest.mark.parametrize(("rule", "ordering"), list(itertools.product(RULES, ORDERINGS)))
def test_alignment_pads_every_size(rule: str, ordering: str) -> None:
    p = problem((0, 2, 100), (1, 3, 300), (1, 2, 1), alignment=256)
    placed = greedy(p, rule, ordering)
    assert all(o % 256 == 0 for o in placed.offsets)
    assert placed.height == 1024  # 256 + 512 + 256, all live at tick 1
    validate(p, placed)


def test_greedy_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"unknown rule 'best' \(known: canonical, fit\)"):
        greedy(SIX, "best", "size")
    with pytest.raises(ValueError, match=r"unknown ordering 'colour' \(known: length, size"):
        greedy(SIX, "fit", "colour")


# -- the solver ---------------------------------------------------------------------------------


def brute_force_search(
    p: Problem, capacity: int, time_limit_s: float, hint: tuple[int, ...] | None = None
) -> tuple[str, tuple[int, ...] | None]:
    """An exact search for tiny problems: every order, each buffer at its lowest free offset.

    Sorting any placement by offset and replaying it this way never rises, so
    some order reaches the optimum."""
    a = p.alignment
    sizes = [-(-b.size // a) * a for b in p.buffers]
    n = len(p.buffers)
    for order in itertools.permutations(range(n)):
        offsets = [0] * n
        done: list[int] = []
        for i in order:
            b, o = p.buffers[i], 0
            while True:
                tops = [
                    offsets[j] + sizes[j]
                    for j in done
                    if p.buffers[j].lower < b.upper
                    and b.lower < p.buffers[j].upper
                    and offsets[j] < o + sizes[i]
                    and o < offsets[j] + sizes[j]
                ]
                if not tops:
                    break
                o = max(tops)
            offsets[i] = o
            done.append(i)
        if max(o + s for o, s in zip(offsets, sizes, strict=True)) <= capacity:
            return "feasible", tuple(offsets)
    return "infeasible", None


def scaled(rows: tuple[tuple[int, int, int], ...], alignment: int) -> Problem:
    """With alignment 256, sizes s*256 - 85: every one pads back to s*256."""
    if alignment == 1:
        return problem(*rows)
    return problem(*((lo, up, s * 256 - 85) for lo, up, s in rows), alignment=256)


@pytest.mark.parametrize("alignment", [1, 256])
@pytest.mark.parametrize(
    ("rows", "orderings", "improve", "exact", "height", "solver"),
    [
        # SEVEN: bound 15. "start" alone: canonical 18, fit 21, SmartPool 16.
        (SEVEN, ("start",), False, False, 16, "smartpool"),
        (SEVEN, ("start",), False, True, 15, "exact"),
        (SEVEN, ("start",), True, False, 15, "canonical+improve"),
        (SEVEN, ("start",), True, True, 15, "canonical+improve"),  # no search needed
        (SEVEN, ORDERINGS, False, False, 16, "canonical/size"),
        (SEVEN, ORDERINGS, False, True, 15, "exact"),
        (SEVEN, ORDERINGS, True, False, 16, "canonical/size"),  # perturbing size's order fails
        (SEVEN, ORDERINGS, True, True, 15, "exact"),
        # SEVEN_B: bound 10.
        (SEVEN_B, ("start",), False, False, 12, "canonical/start"),
        (SEVEN_B, ("start",), False, True, 10, "exact"),
        (SEVEN_B, ("start",), True, False, 10, "canonical+improve"),
        (SEVEN_B, ("start",), True, True, 10, "canonical+improve"),
        (SEVEN_B, ORDERINGS, False, False, 12, "canonical/length"),
        (SEVEN_B, ORDERINGS, False, True, 10, "exact"),
        (SEVEN_B, ORDERINGS, True, False, 12, "canonical/length"),
        (SEVEN_B, ORDERINGS, True, True, 10, "exact"),
    ],
)
def test_solve_every_option_combination(
    rows: tuple[tuple[int, int, int], ...],
    orderings: tuple[str, ...],
    improve: bool,
    exact: bool,
    alignment: int,
    height: int,
    solver: str,
) -> None:
    p = scaled(rows, alignment)
    unit = 1 if alignment == 1 else 256
    placed = solve(
        p,
        use_exact=exact,
        search=brute_force_search if exact else None,
        orderings=orderings,
        improve=improve,
    )
    validate(p, placed)
    assert placed.height == height * unit
    assert placed.solver == solver
    assert placed.optimal is (placed.height == lower_bound(p))
    assert placed.stats["lower_bound"] == lower_bound(p)
    assert placed.height <= smartpool(p).height


def test_solve_is_deterministic() -> None:
    p = read_problem_csv(shared_file("traces/minimalloc/challenging/B.1048576.csv"))
    first = solve(p, use_exact=False)
    second = solve(p, use_exact=False)
    assert first.offsets == second.offsets
    assert (first.height, first.solver) == (second.height, second.solver)
    assert first.height == 1182720  # 1.1279 × the bound, SmartPool 1412096
    assert first.solver == "canonical+improve"


def test_solve_empty_problem() -> None:
    placed = solve(problem())
    assert (placed.offsets, placed.height, placed.optimal) == ((), 0, True)


def test_solve_refuses_bad_options() -> None:
    with pytest.raises(ValueError, match="unknown ordering 'random'"):
        solve(SIX, orderings=("size", "random"))
    with pytest.raises(ValueError, match="at least one ordering is needed"):
        solve(SIX, orderings=())
    with pytest.raises(ValueError, match="alignment must be at least 1, got -8"):
        solve(problem((0, 1, 1), alignment=-8))


def test_solve_stops_at_the_bound_and_reports_progress() -> None:
    lines: list[str] = []
    placed = solve(SIX, progress=lines.append)
    assert placed.solver == "canonical/length"
    assert placed.optimal
    assert placed.stats["greedy_runs"] == 1
    assert lines == ["canonical/length: height 7 (1.0000 × lower bound)"]


# -- the exact phase, with scripted searches -----------------------------------------------------


class Scripted:
    """A search that answers by capacity from a table and records what it was asked."""

    def __init__(self, answers: dict[int, tuple[str, tuple[int, ...] | None]]) -> None:
        self.answers = answers
        self.asked: list[int] = []

    def __call__(
        self, p: Problem, capacity: int, time_limit_s: float, hint: tuple[int, ...] | None = None
    ) -> tuple[str, tuple[int, ...] | None]:
        self.asked.append(capacity)
        assert hint is not None and len(hint) == len(p.buffers)
        return self.answers.get(capacity, ("timeout", None))


def heuristic_only(rows: tuple[tuple[int, int, int], ...]) -> tuple[Problem, int]:
    p = problem(*rows)
    return p, solve(p, use_exact=False, orderings=("start",), improve=False).height


def test_exact_infeasible_answers_prove_optimality() -> None:
    p, height = heuristic_only(SEVEN_B)  # 12; the bound is 10
    assert height == 12
    search = Scripted({10: ("infeasible", None), 11: ("infeasible", None)})
    placed = solve(p, search=search, orderings=("start",), improve=False)
    assert search.asked == [10, 11]
    assert (placed.height, placed.optimal, placed.solver) == (12, True, "canonical/start")
    assert placed.stats["exact_calls"] == 2


def test_exact_timeouts_prove_nothing() -> None:
    p, _ = heuristic_only(SEVEN_B)
    lines: list[str] = []
    search = Scripted({})
    placed = solve(p, search=search, orderings=("start",), improve=False, progress=lines.append)
    assert search.asked == [10, 11]  # the bound, then the only height left below 12
    assert (placed.height, placed.optimal) == (12, False)
    assert "exact: capacity 11: timeout" in "\n".join(lines)


def test_exact_feasible_answer_is_taken() -> None:
    p, _ = heuristic_only(SEVEN_B)
    good = brute_force_search(p, 11, 1.0)
    assert good[0] == "feasible"
    search = Scripted({10: ("timeout", None), 11: good})
    placed = solve(p, search=search, orderings=("start",), improve=False)
    assert search.asked == [10, 11]
    assert placed.offsets == good[1]
    assert (placed.height, placed.solver) == (11, "exact")
    assert not placed.optimal  # 10 timed out: unproven


def test_exact_answer_refused_by_the_validator_is_dropped() -> None:
    p, height = heuristic_only(SEVEN_B)
    lines: list[str] = []
    search = Scripted({10: ("feasible", (0,) * 7)})  # everything at 0: overlaps
    placed = solve(p, search=search, orderings=("start",), improve=False, progress=lines.append)
    assert (placed.height, placed.solver) == (height, "canonical/start")
    assert any("answer refused by the validator: buffers 0 and 2 overlap" in x for x in lines)


def test_exact_search_that_fails_costs_only_its_answer() -> None:
    def broken(*args: object) -> tuple[str, None]:
        raise RuntimeError("out of nodes")

    p, height = heuristic_only(SEVEN_B)
    lines: list[str] = []
    placed = solve(p, search=broken, orderings=("start",), improve=False, progress=lines.append)
    assert placed.height == height
    assert lines[-1] == "exact: capacity 10: the search failed: RuntimeError: out of nodes"


def test_exact_module_missing_means_heuristics_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "_import_search", lambda: None)
    p, height = heuristic_only(SEVEN_B)
    lines: list[str] = []
    placed = solve(p, orderings=("start",), improve=False, progress=lines.append)
    assert placed.height == height
    assert lines[-1] == "exact search not available: heuristics only"


def test_deadline_keeps_the_first_run_and_stops_the_rest() -> None:
    ticks = iter(range(0, 10_000))

    def clock() -> float:  # one second per look at the clock
        return float(next(ticks))

    p = problem(*SEVEN_B)
    placed = solve(p, time_limit_s=0.5, clock=clock, search=brute_force_search)
    validate(p, placed)
    assert (placed.height, placed.solver) == (12, "canonical/length")  # the first run
    assert placed.stats["greedy_runs"] == 1
    assert "improve_rounds" not in placed.stats
    assert placed.stats["exact_calls"] == 0


def test_real_exact_search_reaches_the_peak_of_challenging_a() -> None:
    pytest.importorskip("tidalplan.exact")
    p = read_problem_csv(shared_file("traces/minimalloc/challenging/A.1048576.csv"))
    placed = solve(p, time_limit_s=10.0)
    validate(p, placed)
    assert (placed.height, placed.optimal, placed.solver) == (1048576, True, "exact")


# -- properties ---------------------------------------------------------------------------------

rows_strategy = st.lists(
    st.tuples(st.integers(0, 12), st.integers(1, 6), st.integers(1, 40)).map(
        lambda t: (t[0], t[0] + t[1], t[2])
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, alignment=st.sampled_from([1, 8, 256]))
def test_solve_is_valid_between_bound_and_smartpool(
    rows: list[tuple[int, int, int]], alignment: int
) -> None:
    p = problem(*rows, alignment=alignment)
    placed = solve(p, time_limit_s=5.0, use_exact=False)
    validate(p, placed)
    bound = lower_bound(p)
    assert bound <= placed.height <= smartpool(p).height
    assert placed.optimal is (placed.height == bound)
    for rule, ordering in itertools.product(RULES, ORDERINGS):
        validate(p, greedy(p, rule, ordering))
    validate(p, smartpool(p))


@settings(max_examples=30, deadline=None)
@given(rows=rows_strategy)
def test_solve_with_exact_search_is_valid(rows: list[tuple[int, int, int]]) -> None:
    p = problem(*rows)
    placed = solve(p, time_limit_s=5.0)
    validate(p, placed)
    assert lower_bound(p) <= placed.height <= smartpool(p).height


@pytest.mark.parametrize("limit", [-1.0, float("nan")])
def test_solve_refuses_a_time_limit_that_is_no_number_of_seconds(limit: float) -> None:
    with pytest.raises(ValueError, match="time_limit_s must be a number of seconds >= 0"):
        solve(SIX, time_limit_s=limit)
