"""The exact search: exact offsets on hand-made cases, exact answers against brute force."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tidalcore.units import Bytes, Tick
from tidaloffline.formats import read_problem_csv
from tidalplan import _exact
from tidalplan.exact import search
from tidalplan.model import Buffer, Problem

from ..conftest import shared_file


def problem(*specs: tuple[int, int, int], alignment: int = 1) -> Problem:
    """Buffers from (lower, upper, size), numbered in order."""
    return Problem(
        tuple(Buffer(i, Tick(lo), Tick(hi), Bytes(s)) for i, (lo, hi, s) in enumerate(specs)),
        alignment,
    )


def overlaps(p: Problem, offsets: tuple[int, ...], capacity: int) -> list[tuple[int, int]]:
    """Each violated pair, (i, i) for a buffer out of bounds: shares no code with the search."""
    bad = []
    for i, (a, oa) in enumerate(zip(p.buffers, offsets, strict=True)):
        if oa < 0 or oa + a.size > capacity or oa % p.alignment:
            bad.append((i, i))
        for j in range(i):
            b, ob = p.buffers[j], offsets[j]
            if a.lower < b.upper and b.lower < a.upper and oa < ob + b.size and ob < oa + a.size:
                bad.append((j, i))
    return bad


def test_three_overlapping_fill_exactly_their_sum() -> None:
    p = problem((0, 10, 4), (0, 10, 4), (0, 10, 4))
    assert search(p, 12, 1.0) == ("feasible", (0, 4, 8))
    assert search(p, 11, 1.0) == ("infeasible", None)


def test_disjoint_lifetimes_share_addresses() -> None:
    # b0 [0, 5) and b1 [5, 9) never live together: both sit at 2, on b2, which spans both.
    p = problem((0, 5, 8), (5, 9, 8), (0, 9, 2))
    assert search(p, 10, 1.0) == ("feasible", (2, 2, 0))
    assert search(p, 9, 1.0) == ("infeasible", None)


def test_where_first_fit_by_start_fails_a_packing_exists() -> None:
    # First fit in start order puts b1 at 0, b2 at 1 and b0 at 2: height 4. Peak is 3:
    #   b2 at 0 for the whole span, b1 and b0 (never together) at 1 on top of it.
    p = problem((4, 5, 2), (0, 1, 1), (0, 6, 1))
    assert search(p, 3, 1.0) == ("feasible", (1, 1, 0))
    assert search(p, 2, 1.0) == ("infeasible", None)


def test_a_buffer_rests_on_one_that_ends_before_it() -> None:
    # b1 must sit on b0 while both live, and keeps that offset after b0 ends: a gap.
    p = problem((0, 2, 2), (1, 3, 1), (3, 4, 3))
    assert search(p, 3, 1.0) == ("feasible", (0, 2, 0))
    assert search(p, 2, 1.0) == ("infeasible", None)


def test_alignment_rounds_sizes_up_and_capacity_down() -> None:
    # In 256-byte units the sizes are 1, 2 and 1: four units, 1024 bytes.
    p = problem((0, 4, 100), (0, 4, 300), (0, 4, 256), alignment=256)
    assert search(p, 1024, 1.0) == ("feasible", (512, 0, 768))
    assert search(p, 1023, 1.0) == ("infeasible", None)
    assert search(p, 1279, 1.0) == ("feasible", (512, 0, 768))


def test_empty_problem_and_one_too_large() -> None:
    assert search(problem(), 0, 1.0) == ("feasible", ())
    assert search(problem((0, 1, 5)), 4, 1.0) == ("infeasible", None)
    assert search(problem((0, 1, 5)), 5, 0.0) == ("feasible", (0,))


def test_independent_parts_are_solved_apart() -> None:
    # Two copies of the three-overlapping case, far apart in time.
    p = problem((0, 10, 4), (0, 10, 4), (0, 10, 4), (20, 30, 4), (20, 30, 4), (20, 30, 4))
    assert search(p, 12, 1.0) == ("feasible", (0, 4, 8, 0, 4, 8))
    assert search(p, 11, 1.0) == ("infeasible", None)


def _corrupt(buf: Buffer, **fields: int) -> Buffer:
    """A Buffer whose fields bypass its own validation (as a careless caller might)."""
    for name, value in fields.items():
        object.__setattr__(buf, name, value)
    return buf


@pytest.mark.parametrize(
    ("p", "capacity", "limit", "message"),
    [
        (problem((0, 1, 4)), -1, 1.0, "capacity must be non-negative, got -1"),
        (problem((0, 1, 4)), 8, -0.5, "time limit must be non-negative, got -0.5"),
        (problem((0, 1, 4)), 8, float("nan"), "time limit must be non-negative, got nan"),
        (problem((0, 1, 4), alignment=0), 8, 1.0, "alignment must be positive, got 0"),
        (
            Problem((_corrupt(Buffer(7, Tick(0), Tick(1), Bytes(4)), size=-3),)),
            8,
            1.0,
            "buffer 7: size must be positive, got -3",
        ),
        (
            Problem((_corrupt(Buffer(9, Tick(0), Tick(1), Bytes(4)), upper=0),)),
            8,
            1.0,
            r"buffer 9: empty lifetime \[0, 0\)",
        ),
        (problem((0, 2**63, 4)), 8, 1.0, "does not fit in 64 bits"),
    ],
)
def test_bad_input_is_a_value_error(p: Problem, capacity: int, limit: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        search(p, capacity, limit)


@pytest.mark.parametrize(
    ("lowers", "uppers", "sizes", "capacity", "message"),
    [
        ([0, 0], [1], [1], 4, "int64 arrays of one length"),
        ([0], [1], [-1], 4, "buffer 0: size out of range"),
        ([0], [1], [0], 4, "buffer 0: size out of range"),
        ([0, 0], [1, 1], [2**61, 2**61 + 1], 4, "buffer 1: size out of range"),
        ([3], [3], [1], 4, "buffer 0: empty lifetime"),
        ([0], [1], [1], -4, "capacity and time limit must be non-negative"),
    ],
)
def test_the_core_checks_its_own_input(
    lowers: list[int], uppers: list[int], sizes: list[int], capacity: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _exact.search(array("q", lowers), array("q", uppers), array("q", sizes), capacity, 1.0)
    with pytest.raises(ValueError, match="int64 arrays"):
        _exact.search(b"\0" * 7, b"\0" * 7, b"\0" * 7, 1, 1.0)


def load(name: str) -> Problem:
    return read_problem_csv(shared_file(f"traces/minimalloc/challenging/{name}.1048576.csv"))


def test_challenging_a_is_solved_at_its_peak_load() -> None:
    p = load("A")
    status, offsets = search(p, 1_048_576, 10.0)
    assert status == "feasible" and offsets is not None
    assert overlaps(p, offsets, 1_048_576) == []
    assert search(p, 1_048_575, 10.0) == ("infeasible", None)  # the peak load: proved at once


def test_a_hard_capacity_times_out() -> None:
    # D's peak load is 986112, far below any height found for it (1,018,880 at best):
    # neither a placement nor a proof comes within 10 ms.
    assert search(load("D"), 986_112, 0.01) == ("timeout", None)


def brute_force(p: Problem, capacity: int) -> bool:
    """Tries every offset of every buffer in turn, backtracking on the first overlap."""
    bufs, offsets = p.buffers, [0] * len(p.buffers)

    def fits(i: int, o: int) -> bool:
        a = bufs[i]
        return all(
            not (a.lower < b.upper and b.lower < a.upper)
            or o + a.size <= offsets[j]
            or offsets[j] + b.size <= o
            for j, b in enumerate(bufs[:i])
        )

    def place(i: int) -> bool:
        if i == len(bufs):
            return True
        for o in range(capacity - bufs[i].size + 1):
            if fits(i, o):
                offsets[i] = o
                if place(i + 1):
                    return True
        return False

    return place(0)


small_problems = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 4), st.integers(1, 3)).map(
        lambda t: (t[0], t[0] + t[1], t[2])
    ),
    min_size=1,
    max_size=6,
).map(lambda specs: problem(*specs))


@settings(max_examples=150, deadline=None)
@given(small_problems, st.integers(0, 8))
def test_feasible_exactly_when_brute_force_finds_a_packing(p: Problem, capacity: int) -> None:
    status, offsets = search(p, capacity, 5.0)
    assert status == ("feasible" if brute_force(p, capacity) else "infeasible")
    if offsets is not None:
        assert overlaps(p, offsets, capacity) == []
    assert search(p, capacity, 5.0) == (status, offsets)  # deterministic
