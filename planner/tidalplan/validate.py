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

import itertools
import math
from bisect import bisect_left
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from tidalplan.model import Iteration, Placement, Problem

if TYPE_CHECKING:  # types only: the checks share no code with the simulator
    from tidalplan.model import SwapPlan
    from tidalplan.simulate import Result

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


class InvalidSwapPlan(ValueError):
    """A swap plan whose simulated timeline breaks a promise; the message names the swap."""


def validate_swaps(
    it: Iteration,
    plan: SwapPlan,
    result: Result,
    limit: int | None,
    in_gbps: float,
    compute_scale: float = 1.0,
) -> None:
    """Check a simulated plan from its timeline alone (`result.tick_ns`, `.swap_ns`,
    `.swap_ticks`, `.rebuild_ns`), recomputing device bytes without the simulator's code:

    - no block is accessed by an op strictly between its swap's (or drop's) two ops;
    - every swap-out finished and every swap-in started, after the swap-out finished, and
      completed (start + its copy time at `in_gbps`) no later than the op that needs it began;
    - every recomputed block is rebuilt by the ops that wrote it before it was dropped, run
      again between the end of the op before the one that needs it and that op's start,
      which leaves room for their durations (× `compute_scale`); every block they read is
      rebuilt with it or is on the device then and unchanged since they first ran;
    - at every tick, the device bytes (persistent bytes and the blocks live at that tick,
      less the blocks away from it) are at most `limit`, with a rebuild's scratch (the
      other blocks its ops write) added at the op it rebuilds for.
    """
    if not result.feasible:
        raise InvalidSwapPlan("the simulation did not finish: the plan is infeasible")
    n = len(plan.swaps)
    if (
        len(result.tick_ns) != it.ticks
        or len(result.swap_ns) != n
        or len(result.swap_ticks) != n
        or len(result.rebuild_ns) != len(plan.recomputes)
    ):
        raise InvalidSwapPlan("the result is not the simulation of this plan on this iteration")
    times = result.tick_ns
    accessed: dict[int, list[int]] = {}
    for a in it.accesses:
        accessed.setdefault(a.block, []).append(a.tick)
    away: list[tuple[int, int, int, bool]] = []  # (size, gone tick, back tick, crosses)
    for s, (left, back), (gone_t, back_t) in zip(
        plan.swaps, result.swap_ns, result.swap_ticks, strict=True
    ):
        pid, size = (
            it.persistent[s.block]
            if s.persistent
            else (it.blocks[s.block].id, it.blocks[s.block].size)
        )
        crosses = s.in_before <= s.out_after
        if crosses and not it.boundary_swaps:
            raise InvalidSwapPlan(
                f"{s}: away across the boundary of an iteration whose persistent blocks stay on"
                " the device there"
            )
        between = [
            t
            for t in accessed.get(pid, ())
            if (s.out_after < t < s.in_before) or (crosses and (t > s.out_after or t < s.in_before))
        ]
        if between:
            raise InvalidSwapPlan(f"{s}: its block is accessed at tick {between[0]} while away")
        if min(gone_t, back_t) < 0 or max(left, back) >= 1 << 62:
            raise InvalidSwapPlan(f"{s}: its swap-out or swap-in never happened")
        if not crosses and (back < left or back_t < gone_t):
            raise InvalidSwapPlan(f"{s}: swapped in at {back} ns before it left at {left} ns")
        ready = back + math.ceil(Fraction(size) / Fraction(in_gbps))  # bytes / (bytes per ns)
        if ready > times[s.in_before]:
            raise InvalidSwapPlan(
                f"{s}: back at {ready} ns but op {s.in_before} began at {times[s.in_before]} ns"
            )
        if back_t > s.in_before:
            raise InvalidSwapPlan(f"{s}: back only at tick {back_t}, after op {s.in_before}")
        away.append((size, gone_t, back_t, crosses))
    scratch = _check_rebuilds(it, plan, result, away, compute_scale)
    if limit is None:
        return
    persistent = sum(size for _, size in it.persistent)
    # Transient bytes at each tick (previous instances of crossing blocks too), from a
    # difference array over the periodic tick axis.
    n = it.ticks
    steps = [0] * (n + 1)
    always = 0
    for b in it.blocks:
        whole, rest = divmod(b.end - b.start, n)
        always += whole * b.size
        first = b.start % n
        if first + rest <= n:
            steps[first] += b.size
            steps[first + rest] -= b.size
        else:
            steps[first] += b.size
            steps[0] += b.size
            steps[first + rest - n] -= b.size
    live = list(itertools.accumulate(steps[:n], initial=always))[1:]
    off = [0] * (it.ticks + 1)  # bytes away at each tick (difference array)
    for nbytes, gone_t, back_t, crosses in away:
        if crosses:
            off[0] += nbytes
            off[back_t] -= nbytes
        off[gone_t] += nbytes
        off[it.ticks if crosses else back_t] -= nbytes
    gone = 0
    for t in range(it.ticks):
        gone += off[t]
        device = persistent + live[t] - gone + scratch.get(t, 0)
        if device > limit:
            raise InvalidSwapPlan(f"tick {t} at {times[t]} ns: {device} device bytes > {limit}")


def _check_rebuilds(
    it: Iteration,
    plan: SwapPlan,
    result: Result,
    away: list[tuple[int, int, int, bool]],
    compute_scale: float,
) -> dict[int, int]:
    """The recomputations' checks (see `validate_swaps`); appends each drop to `away` and
    returns the scratch bytes of the rebuild at each op tick that has one."""
    if not plan.recomputes:
        return {}
    times = result.tick_ns
    ns: dict[int, int] = {int(op.tick): round(op.duration_ns * compute_scale) for op in it.ops}
    ticks = sorted(ns)
    block_of = {b.id: b for b in it.blocks}
    size_of = {b.id: b.size for b in it.blocks} | dict(it.persistent)
    history: dict[int, list[tuple[int, bool]]] = {}  # block id -> (tick, write) in trace order
    at_op: dict[int, list[tuple[int, bool]]] = {}  # op tick -> (block id, write)
    for a in it.accesses:
        history.setdefault(a.block, []).append((a.tick, a.write))
        at_op.setdefault(a.tick, []).append((a.block, a.write))
    at: dict[int, list[int]] = {}  # the op tick it is rebuilt for -> recomputation indices
    for j, r in enumerate(plan.recomputes):
        if not 0 <= r.block < len(it.blocks) or r.drop_after not in ns or r.before not in ns:
            raise InvalidSwapPlan(f"{r}: not a block and two op ticks of this iteration")
        b = it.blocks[r.block]
        if not b.start < r.drop_after < r.before < b.end:
            raise InvalidSwapPlan(f"{r}: outside its block's lifetime [{b.start}, {b.end})")
        during = [t for t, _ in history.get(b.id, ()) if r.drop_after < t < r.before]
        if during:
            raise InvalidSwapPlan(f"{r}: its block is accessed at tick {during[0]} while dropped")
        away.append((b.size, r.drop_after + 1, r.before, False))
        at.setdefault(r.before, []).append(j)

    gone: dict[int, list[tuple[int, int, bool]]] = {}  # block id -> ticks away [from, to)
    for sw, (left, back) in zip(plan.swaps, result.swap_ticks, strict=True):
        pid = it.persistent[sw.block][0] if sw.persistent else it.blocks[sw.block].id
        gone.setdefault(pid, []).append((left, back, sw.in_before <= sw.out_after))
    for r in plan.recomputes:
        gone.setdefault(it.blocks[r.block].id, []).append((r.drop_after + 1, r.before, False))

    def resident(pid: int, tick: int) -> bool:
        """Block `pid` holds its bytes on the device at op `tick`."""
        b = block_of.get(pid)  # None: a persistent block, or none of this iteration
        if pid not in size_of or (b is not None and not b.start <= tick < b.end):
            return False
        return not any(
            (lo <= tick or tick < hi) if wraps else lo <= tick < hi
            for lo, hi, wraps in gone.get(pid, ())
        )

    scratch: dict[int, int] = {}
    for before, members in at.items():
        ids = {it.blocks[plan.recomputes[j].block].id for j in members}
        writers: set[int] = set()
        for j in members:
            r = plan.recomputes[j]
            b = it.blocks[r.block]
            mine = {t for t, w in history.get(b.id, ()) if w and b.start <= t <= r.drop_after}
            if not mine:
                raise InvalidSwapPlan(f"{r}: nothing writes its block before it is dropped")
            writers |= mine
        extra: set[int] = set()
        for w in writers:
            for pid, write in at_op.get(w, ()):
                if pid in ids:
                    continue
                if write:
                    extra.add(pid)
                    continue
                if not resident(pid, before):
                    raise InvalidSwapPlan(
                        f"op {w}, run again for op {before}, reads block {pid}, which is"
                        " not on the device then"
                    )
                if any(w <= t < before and wr for t, wr in history[pid]):
                    raise InvalidSwapPlan(
                        f"op {w}, run again for op {before}, reads block {pid}, which is"
                        " written again in between"
                    )
        scratch[before] = sum(size_of.get(pid, 0) for pid in extra)
        started = {result.rebuild_ns[j] for j in members}
        if len(started) != 1:
            raise InvalidSwapPlan(f"the rebuild for op {before} started at several times")
        start = started.pop()
        k = bisect_left(ticks, before)
        previous_end = times[ticks[k - 1]] + ns[ticks[k - 1]] if k else 0
        work = sum(ns[w] for w in writers)
        if start < previous_end or start + work > times[before]:
            raise InvalidSwapPlan(
                f"the rebuild for op {before} ({work} ns from {start} ns) does not fit between"
                f" the end of the op before it ({previous_end} ns) and op {before}"
                f" ({times[before]} ns)"
            )
    return scratch
