"""Exact feasibility search for a placement at a given capacity (MiniMalloc-style).

A thin wrapper over the C core `_exact`: it converts bytes to alignment units
(sizes rounded up, capacity rounded down), calls the search with the GIL
released, and maps the offsets back to bytes. The search is exact and anytime:
it answers "feasible" with offsets, "infeasible" when it has proved that no
placement fits, or "timeout" when the time limit ran out first.
"""

from __future__ import annotations

import math
from array import array

from tidalplan import _exact
from tidalplan.model import Problem


def search(
    problem: Problem,
    capacity: int,
    time_limit_s: float,
    hint: tuple[int, ...] | None = None,
) -> tuple[str, tuple[int, ...] | None]:
    """Feasibility at `capacity`: ("feasible", offsets) | ("infeasible", None) | ("timeout", None).

    Offsets are parallel to problem.buffers and multiples of problem.alignment.
    Deterministic, except where the time limit decides. `hint` (a known placement) is
    accepted and, for now, ignored: the search orders values by its own preorders.
    """
    del hint
    alignment = problem.alignment
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, got {alignment}")
    if capacity < 0:
        raise ValueError(f"capacity must be non-negative, got {capacity}")
    if math.isnan(time_limit_s) or time_limit_s < 0:
        raise ValueError(f"time limit must be non-negative, got {time_limit_s}")
    for b in problem.buffers:
        if b.size <= 0:
            raise ValueError(f"buffer {b.id}: size must be positive, got {b.size}")
        if b.upper <= b.lower:
            raise ValueError(f"buffer {b.id}: empty lifetime [{b.lower}, {b.upper})")
    try:
        lowers = array("q", [b.lower for b in problem.buffers])
        uppers = array("q", [b.upper for b in problem.buffers])
        sizes = array("q", [-(-b.size // alignment) for b in problem.buffers])
        units = min(capacity // alignment, 2**63 - 1)
    except OverflowError as e:
        raise ValueError(f"a tick or size does not fit in 64 bits: {e}") from None
    status, offsets = _exact.search(lowers, uppers, sizes, units, time_limit_s)
    if offsets is None:
        return status, None
    placed = tuple(o * alignment for o in offsets)
    if __debug__:
        _check(problem, capacity, placed)
    return status, placed


def _check(problem: Problem, capacity: int, offsets: tuple[int, ...]) -> None:
    """Asserts the placement is sound: a sweep over time, comparing live neighbours."""
    bufs = problem.buffers
    assert len(offsets) == len(bufs)
    live: list[int] = []
    for i in sorted(range(len(bufs)), key=lambda i: bufs[i].lower):
        b, o = bufs[i], offsets[i]
        assert o % problem.alignment == 0 and o >= 0 and o + b.size <= capacity, (b, o)
        live = [j for j in live if bufs[j].upper > b.lower]
        for j in live:
            assert o + b.size <= offsets[j] or offsets[j] + bufs[j].size <= o, (b, bufs[j])
        live.append(i)
