"""Swap gaps, and a greedy cover of the excess that schedules the copies against the engines.

The published policies choose *which* blocks to swap and leave *when* to the
copy engines: AutoSwap ranks blocks by how long they are away, vDNN and
SuperNeurons take whole layer classes. On a fast GPU the engines, not the gaps,
are the bottleneck (at 12 GB/s a 20 ms iteration moves 240 MB each way), so a
plan that ignores them queues copies behind each other and compute waits.

`construct` schedules the copies itself, on the no-stall timeline of the trace:

    time ──────────────────────────────────────────────────────────────▶
    compute  [op a]─────────────── ... ───────────────[op c]
    out          └─[copy out, FIFO after earlier outs]┐
    in                               ┌─[copy in, as late as possible]┘ ends by op c
    off the device:                  f ──────────── s      (ticks in [f, s) are covered)

1. Candidates (`gaps`) are all gaps between two consecutive accesses of a block:
   every gap of a transient block (so a block can be swapped more than once, which
   is how limits below AutoSwap's `load_min` are reached) and, for persistent
   blocks (weights, optimizer state), the gaps inside the iteration and the one
   across its boundary.
2. Greedy covering in time order: at the first tick whose load is over the
   limit, try the most promising gaps that span it (`_BEAM` of them), each
   added to the plan with the whole schedule recomputed as the simulator runs
   it (swap-outs FIFO in op order; swap-ins as late as possible, back to back,
   each done before its op); of those that lower the tick without a stall and
   without uncovering an earlier tick, keep the best by one of three `RULES`. When no gap can
   be added without a stall, the rest is covered by the most promising gaps
   regardless of the engines (`simulate` then charges the stalls).

Both are starts for tidalpool's policy, `search`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from tidalcore.units import Tick

from tidalplan.model import Iteration, Swap, SwapPlan
from tidalplan.profile import durations, load
from tidalplan.simulate import copy_ns

_BEAM = 24  # gaps tried in full at each greedy step

Rule = Literal["gain", "gain-per-byte", "engine-first"]
RULES: tuple[Rule, ...] = ("gain", "gain-per-byte", "engine-first")


@dataclass(frozen=True, slots=True)
class Gap:
    """A block may be away between two consecutive accesses, op ticks `a` and `c`."""

    block: int
    persistent: bool
    size: int
    a: Tick  # the access before (the swap-out follows op a)
    c: Tick  # the access after (op c needs the block back); c <= a: across the boundary
    out_ns: int
    in_ns: int

    @property
    def wraps(self) -> bool:
        return self.c <= self.a


def gaps(it: Iteration, out_gbps: float, in_gbps: float) -> list[Gap]:
    """Every gap between consecutive accesses, of transient and persistent blocks (a
    persistent block's across the boundary too, unless `it.boundary_swaps` is False)."""
    ticks: dict[int, set[int]] = {}
    for acc in it.accesses:
        ticks.setdefault(acc.block, set()).add(acc.tick)
    out: list[Gap] = []

    def add(block: int, persistent: bool, size: int, a: int, c: int) -> None:
        out.append(
            Gap(
                block,
                persistent,
                size,
                Tick(a),
                Tick(c),
                copy_ns(size, out_gbps),
                copy_ns(size, in_gbps),
            )
        )

    for i, b in enumerate(it.blocks):
        mine = sorted(t for t in ticks.get(b.id, ()) if b.start < t < b.end)
        for a, c in itertools.pairwise(mine):
            add(i, False, b.size, a, c)
    for j, (pid, size) in enumerate(it.persistent):
        mine = sorted(ticks.get(pid, ()))
        for a, c in itertools.pairwise(mine):
            add(j, True, size, a, c)
        if mine and it.boundary_swaps:
            add(j, True, size, mine[-1], mine[0])
    return out


class _Timeline:
    """The trace's no-stall timeline, and the bytes that must be away at each tick."""

    def __init__(self, it: Iteration, limit: int) -> None:
        dur = durations(it)
        self.ticks = it.ticks
        self.start = np.concatenate(([0], np.cumsum(dur)[:-1])).astype(np.int64)  # tick start ns
        self.end_of = self.start + dur  # end of each tick (an op's end)
        self.total = int(dur.sum())
        self.need = load(it) - limit  # bytes to be away at each tick

    def first_at_or_after(self, ns: int) -> int:
        return int(np.searchsorted(self.start, ns, side="left"))

    def issue_tick(self, ns: int) -> int:
        """The last tick that starts at or before `ns`."""
        return int(np.searchsorted(self.start, ns, side="right")) - 1


@dataclass(frozen=True, slots=True)
class _Gaps:
    """Every gap as arrays (index k is `gaps(...)[k]`)."""

    a: npt.NDArray[np.int64]
    c: npt.NDArray[np.int64]
    size: npt.NDArray[np.int64]
    out_ns: npt.NDArray[np.int64]
    in_ns: npt.NDArray[np.int64]
    wraps: npt.NDArray[np.bool_]

    @classmethod
    def of(cls, every: list[Gap]) -> _Gaps:
        def column(name: str) -> npt.NDArray[np.int64]:
            return np.array([getattr(g, name) for g in every], np.int64)

        a, c = column("a"), column("c")
        return cls(a, c, column("size"), column("out_ns"), column("in_ns"), c <= a)


@dataclass(frozen=True, slots=True)
class _Schedule:
    """Per chosen gap: when its swap-out ends, when its swap-in starts, the tick issuing it."""

    out_done: npt.NDArray[np.int64]
    in_start: npt.NDArray[np.int64]
    in_at: npt.NDArray[np.int64]


def _schedule(tl: _Timeline, g: _Gaps, chosen: npt.NDArray[np.int64]) -> _Schedule | None:
    """Copy times of the `chosen` gaps as `simulate` runs them with no compute stall; None if
    some copy cannot make its deadline (or a swap-out ends after the iteration).

    Swap-outs run FIFO in (a, c) order: done_k = max(end_k, done_k-1) + o_k, which unrolls to
    S_k + max_j<=k (end_j - S_j-1) over the prefix sums S of the copy times. Swap-ins run as
    late as possible, back to back, latest deadline first: start_k = min(d_k, start_k-1) - i_k,
    likewise min_j<=k (d_j + T_j-1) - T_k."""
    a, c = g.a[chosen], g.c[chosen]
    order = np.lexsort((c, a))
    o = g.out_ns[chosen][order]
    prefix = np.cumsum(o)
    done_sorted = prefix + np.maximum.accumulate(tl.end_of[a[order]] - (prefix - o))
    if int(done_sorted[-1]) > tl.total:
        return None
    out_done = np.empty_like(done_sorted)
    out_done[order] = done_sorted
    deadline = tl.start[c]
    order = np.argsort(-deadline, kind="stable")
    i = g.in_ns[chosen][order]
    prefix = np.cumsum(i)
    start_sorted = np.minimum.accumulate(deadline[order] + (prefix - i)) - prefix
    in_start = np.empty_like(start_sorted)
    in_start[order] = start_sorted
    wraps = g.wraps[chosen]
    if (in_start < np.where(wraps, 0, out_done)).any():
        return None
    issue = np.searchsorted(tl.start, in_start, side="right") - 1
    in_at = np.maximum(issue, np.where(wraps, 0, a + 1))
    if (in_at > c).any():
        return None
    return _Schedule(out_done, in_start, in_at)


def _away(
    tl: _Timeline, g: _Gaps, chosen: npt.NDArray[np.int64], sched: _Schedule
) -> npt.NDArray[np.int64]:
    """Bytes away from the device at each tick under the scheduled plan: from the first tick
    at or after its swap-out ends until the tick issuing its swap-in (which may start during
    that tick, so it is not covered there)."""
    lo = np.searchsorted(tl.start, sched.out_done, side="left")
    hi = sched.in_at
    size = g.size[chosen].astype(np.float64)  # bincount weights; sums stay exact below 2**53
    wraps = g.wraps[chosen]
    inside = ~wraps & (lo < hi)
    n = tl.ticks + 1
    diff = (
        np.bincount(lo[inside], size[inside], n)
        - np.bincount(hi[inside], size[inside], n)
        + np.bincount(lo[wraps], size[wraps], n)
        - np.bincount(hi[wraps], size[wraps], n)
    )
    diff[0] += size[wraps].sum()
    return np.cumsum(diff[:-1]).round().astype(np.int64)


def _ideal_span(tl: _Timeline, g: Gap) -> tuple[int, int]:
    """Ticks [lo, hi) a gap covers with idle copy engines (for a wrapping gap: [lo, ticks) and
    [0, hi)); lo >= hi when the copies do not fit in the gap."""
    lo = tl.first_at_or_after(int(tl.end_of[g.a]) + g.out_ns)
    hi = tl.issue_tick(int(tl.start[g.c]) - g.in_ns)
    return lo, hi


def construct(
    it: Iteration, limit: int, out_gbps: float, in_gbps: float, rule: Rule = "gain"
) -> SwapPlan:
    """Steps 1 and 2: the engine-aware greedy plan for `limit` (not yet judged). `rule` picks
    among the gaps that fit: the most over-limit bytes × ticks removed (`gain`), the same per
    byte moved (`gain-per-byte`), or the earliest end of the swap-out queue (`engine-first`)."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; one of {RULES}")
    tl = _Timeline(it, limit)
    if tl.ticks == 0 or int(tl.need.max()) <= 0:
        return SwapPlan()
    every = gaps(it, out_gbps, in_gbps)
    if not every:
        return SwapPlan()
    g = _Gaps.of(every)
    a, c, size, wraps = g.a, g.c, g.size, g.wraps
    spans = [_ideal_span(tl, x) for x in every]
    lo = np.array([sp[0] for sp in spans], np.int64)
    hi = np.array([sp[1] for sp in spans], np.int64)
    free = np.ones(len(every), bool)
    chosen = np.zeros(0, np.int64)
    sched = _Schedule(chosen, chosen, chosen)
    away = np.zeros(tl.ticks, np.int64)
    late: list[Swap] = []  # picked once no stall-free pick is left
    strict = True
    while True:
        excess = tl.need - away
        over = np.flatnonzero(excess > 0)
        if not len(over):
            break
        t = int(over[0])
        spanning = np.flatnonzero(free & np.where(wraps, (t > a) | (t < c), (a < t) & (t < c)))
        if not len(spanning):
            break  # nothing can lower this tick: simulate will call the plan infeasible
        # Promise: size times the over-limit ticks the gap covers with idle engines.
        positive = np.concatenate(([0], np.cumsum(excess > 0)))
        lo_s, hi_s = np.minimum(lo[spanning], tl.ticks), np.maximum(hi[spanning], 0)
        inside = np.where(hi_s > lo_s, positive[np.maximum(hi_s, lo_s)] - positive[lo_s], 0)
        across = positive[tl.ticks] - positive[lo_s] + positive[np.minimum(hi_s, tl.ticks)]
        promise = np.where(wraps[spanning], across, inside) * size[spanning]
        ranked = spanning[np.lexsort((spanning, -promise))].tolist()
        pick: int | None = None
        if strict:
            best: tuple[int, int, _Schedule, npt.NDArray[np.int64]] | None = None
            before = int(np.maximum(excess, 0).sum())
            for k in ranked[:_BEAM]:
                trial_chosen = np.append(chosen, k)
                trial = _schedule(tl, g, trial_chosen)
                if trial is None:
                    continue
                trial_away = _away(tl, g, trial_chosen, trial)
                left = tl.need - trial_away
                if left[t] >= excess[t] or (t and int(left[:t].max()) > 0):
                    continue  # does not lower tick t, or uncovers an earlier one
                removed = before - int(np.maximum(left, 0).sum())
                if rule == "gain":
                    gain = removed
                elif rule == "gain-per-byte":
                    gain = removed * 1024 // int(size[k])
                else:  # "engine-first": the swap-outs all done soonest
                    gain = -int(trial.out_done.max())
                if best is None or gain > best[0]:
                    best = (gain, k, trial, trial_away)
            if best is not None:
                pick = best[1]
                chosen = np.append(chosen, pick)
                sched, away = best[2], best[3]
            else:
                strict = False  # no stall-free way on: cover the rest, simulate charges stalls
        if pick is None:  # away over its whole gap; the swap-in issued as late as the copy allows
            pick = ranked[0]
            x = every[pick]
            first = 0 if x.wraps else x.a + 1
            late.append(
                Swap(x.block, x.a, x.c, Tick(max(min(int(hi[pick]), x.c), first)), x.persistent)
            )
            whole = _Schedule(
                np.array([tl.end_of[x.a]], np.int64), np.zeros(1, np.int64), np.array([x.c])
            )
            away = away + _away(tl, g, np.array([pick]), whole)
        free[pick] = False
    swaps = [
        Swap(every[k].block, every[k].a, every[k].c, Tick(int(at)), every[k].persistent)
        for k, at in zip(chosen.tolist(), sched.in_at.tolist(), strict=True)
    ]
    return SwapPlan(
        tuple(sorted([*swaps, *late], key=lambda s: (s.out_after, s.in_before, s.block)))
    )
