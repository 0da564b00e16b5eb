"""An independent check of a placement, sharing no code with the solver (MiniMalloc's validator).

It confirms what a plan promises before anything uses it: one offset per
buffer, every offset a non-negative multiple of the alignment, no two buffers
live at the same tick on the same byte (lifetimes are half-open: a buffer freed
at tick t and one allocated at t may share bytes), the claimed height equal to
the highest end (each size rounded up to the alignment), and the height within
the capacity when one is given.

Up to PAIRWISE_MAX buffers every pair is compared; above, a sweep over ticks
keeps the live buffers sorted by offset and compares each newcomer with its
two neighbours there, which suffices because the live buffers never overlap.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from tidalpoold.planner.model import Placement, Problem

PAIRWISE_MAX = 4096
_ROWS = 256  # rows of the pairwise comparison at a time


class InvalidPlacement(ValueError):
    """A placement that must not be used; the message names the buffers and the bytes."""


def validate(problem: Problem, placement: Placement, capacity: int | None = None) -> None:
    """Raise InvalidPlacement at the first broken promise; return None for a good placement."""
    buffers = problem.buffers
    alignment = problem.alignment
    if alignment < 1:
        raise InvalidPlacement(f"alignment must be at least 1, got {alignment}")
    if len(placement.offsets) != len(buffers):
        raise InvalidPlacement(
            f"{len(placement.offsets)} offsets for {len(buffers)} buffers"
            f" (solver {placement.solver})"
        )
    for b, offset in zip(buffers, placement.offsets, strict=True):
        if isinstance(offset, bool) or not isinstance(offset, int | np.integer):
            raise InvalidPlacement(f"buffer {b.id}: offset {offset!r} is not an integer")
        if offset < 0:
            raise InvalidPlacement(f"buffer {b.id}: negative offset {offset}")
        if offset % alignment:
            raise InvalidPlacement(
                f"buffer {b.id}: offset {offset} is not a multiple of the alignment {alignment}"
                f" ({offset % alignment} past {offset - offset % alignment})"
            )
    if len(buffers) <= PAIRWISE_MAX:
        _pairwise(problem, placement)
    else:
        _sweep(problem, placement)
    height = 0
    highest = -1
    for k, (b, offset) in enumerate(zip(buffers, placement.offsets, strict=True)):
        padded = -(-b.size // alignment) * alignment
        if offset + padded > height:
            height, highest = int(offset + padded), k
    if placement.height != height:
        raise InvalidPlacement(
            f"claimed height {placement.height} but the buffers reach {height}"
            + (f" (buffer {buffers[highest].id})" if highest >= 0 else "")
        )
    if capacity is not None and height > capacity:
        b = buffers[highest]
        raise InvalidPlacement(
            f"height {height} exceeds the capacity {capacity}: buffer {b.id} reaches it"
            f" (offset {placement.offsets[highest]}, size {b.size})"
        )


def _overlap_message(problem: Problem, placement: Placement, i: int, j: int) -> str:
    bi, bj = problem.buffers[i], problem.buffers[j]
    oi, oj = int(placement.offsets[i]), int(placement.offsets[j])
    return (
        f"buffers {bi.id} and {bj.id} overlap: both live over ticks"
        f" [{max(bi.lower, bj.lower)}, {min(bi.upper, bj.upper)}) and both hold bytes"
        f" [{max(oi, oj)}, {min(oi + bi.size, oj + bj.size)})"
        f" ({bi.id} at [{oi}, {oi + bi.size}), {bj.id} at [{oj}, {oj + bj.size}))"
    )


def _pairwise(problem: Problem, placement: Placement) -> None:
    """Every pair, a block of rows at a time: the first overlapping pair in input order."""
    n = len(problem.buffers)
    if n < 2:
        return
    lower = np.fromiter((b.lower for b in problem.buffers), np.int64, n)
    upper = np.fromiter((b.upper for b in problem.buffers), np.int64, n)
    size = np.fromiter((b.size for b in problem.buffers), np.int64, n)
    bottom = np.fromiter((int(o) for o in placement.offsets), np.int64, n)
    top = bottom + size
    later = np.arange(n)
    for r0 in range(0, n, _ROWS):
        r1 = min(n, r0 + _ROWS)
        rows = slice(r0, r1)
        clash = (
            (lower[rows, None] < upper[None, :])
            & (lower[None, :] < upper[rows, None])
            & (bottom[rows, None] < top[None, :])
            & (bottom[None, :] < top[rows, None])
            & (later[None, :] > later[rows, None])
        )
        if clash.any():
            i, j = np.argwhere(clash)[0]
            raise InvalidPlacement(_overlap_message(problem, placement, r0 + int(i), int(j)))


def _sweep(problem: Problem, placement: Placement) -> None:
    """Ticks in order, frees before allocations at one tick; live buffers sorted by offset."""
    events: list[tuple[int, int, int]] = []  # (tick, 0 free | 1 allocate, buffer index)
    for k, b in enumerate(problem.buffers):
        events.append((b.lower, 1, k))
        events.append((b.upper, 0, k))
    events.sort()
    live: list[tuple[int, int]] = []  # (offset, buffer index), sorted
    for _, kind, k in events:
        key = (int(placement.offsets[k]), k)
        if kind == 0:
            del live[bisect_left(live, key)]
            continue
        p = bisect_left(live, key)
        start, end = key[0], key[0] + problem.buffers[k].size
        if p > 0:
            below = live[p - 1]
            if below[0] + problem.buffers[below[1]].size > start:
                raise InvalidPlacement(_overlap_message(problem, placement, below[1], k))
        if p < len(live) and live[p][0] < end:
            raise InvalidPlacement(_overlap_message(problem, placement, k, live[p][1]))
        live.insert(p, key)
