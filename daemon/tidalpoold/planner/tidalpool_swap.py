"""tidalpool's swap policy: plan the copies against the copy engines, then keep the best plan.

The published policies choose *which* blocks to swap and leave *when* to the
copy engines: AutoSwap ranks blocks by how long they are away, vDNN and
SuperNeurons take whole layer classes. On a fast GPU the engines, not the gaps,
are the bottleneck (at 12 GB/s a 20 ms iteration moves 240 MB each way), so a
plan that ignores them queues copies behind each other and compute waits.

This policy schedules the copies itself, on the no-stall timeline of the trace:

    time ──────────────────────────────────────────────────────────────▶
    compute  [op a]─────────────── ... ───────────────[op c]
    out          └─[copy out, FIFO after earlier outs]┐
    in                               ┌─[copy in, as late as possible]┘ ends by op c
    off the device:                  f ──────────── s      (ticks in [f, s) are covered)

1. Candidates are all gaps between two consecutive accesses of a block: every
   gap of a transient block (so a block can be swapped more than once, which is
   how limits below AutoSwap's `load_min` are reached) and, for persistent
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
3. The three rules' plans, each also with its swap-ins issued as late as possible (at the op
   that needs the block), are judged by `simulate` together with the `seeds` (the other
   policies' plans for the same limit), and the best is returned: least
   overhead among the feasible, then fewest bytes moved. So the policy is never
   worse in simulation than any plan it is seeded with.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt
from tidalpool.units import Tick

from tidalpoold.planner.autoswap import durations, load
from tidalpoold.planner.model import Iteration
from tidalpoold.planner.simulate import Result, Swap, SwapPlan, copy_ns, simulate

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
    """Every gap between consecutive accesses, of transient and persistent blocks."""
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
        if mine:
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


@dataclass(slots=True)
class _Scheduled:
    gap: Gap
    out_done: int
    in_start: int
    in_at: int  # tick at which the swap-in is issued


def _schedule(tl: _Timeline, chosen: list[Gap]) -> list[_Scheduled] | None:
    """Copy times of `chosen` as `simulate` runs them with no compute stall; None if some copy
    cannot make its deadline (or ends after the iteration)."""
    out_free = 0
    done: dict[int, int] = {}
    for k in sorted(range(len(chosen)), key=lambda k: (chosen[k].a, chosen[k].c)):
        g = chosen[k]
        out_free = max(int(tl.end_of[g.a]), out_free) + g.out_ns
        if out_free > tl.total:
            return None
        done[k] = out_free
    in_start: dict[int, int] = {}
    nxt = 1 << 62
    for k in sorted(range(len(chosen)), key=lambda k: -int(tl.start[chosen[k].c])):
        g = chosen[k]
        s = min(int(tl.start[g.c]), nxt) - g.in_ns
        if s < (0 if g.wraps else done[k]):
            return None
        in_start[k] = nxt = s
    out: list[_Scheduled] = []
    for k, g in enumerate(chosen):
        first = 0 if g.wraps else g.a + 1
        at = max(tl.issue_tick(in_start[k]), first)
        if at > g.c:
            return None
        out.append(_Scheduled(g, done[k], in_start[k], at))
    return out


def _away(tl: _Timeline, plan: Iterable[_Scheduled]) -> npt.NDArray[np.int64]:
    """Bytes away from the device at each tick under the scheduled plan."""
    diff = np.zeros(tl.ticks + 1, np.int64)
    for s in plan:
        lo = tl.first_at_or_after(s.out_done)
        hi = s.in_at  # the in may start during tick `in_at`: not covered there
        if s.gap.wraps:
            diff[0] += s.gap.size
            diff[hi] -= s.gap.size
            diff[lo] += s.gap.size
        elif lo < hi:
            diff[lo] += s.gap.size
            diff[hi] -= s.gap.size
    return np.cumsum(diff[:-1])


def _ideal_span(tl: _Timeline, g: Gap) -> tuple[int, int]:
    """Ticks [lo, hi) a gap covers with idle copy engines (for a wrapping gap: [lo, ticks) and
    [0, hi)); lo >= hi when the copies do not fit in the gap."""
    lo = tl.first_at_or_after(int(tl.end_of[g.a]) + g.out_ns)
    hi = tl.issue_tick(int(tl.start[g.c]) - g.in_ns)
    return lo, hi


def _to_swaps(plan: Iterable[_Scheduled]) -> SwapPlan:
    return SwapPlan(
        tuple(
            Swap(s.gap.block, s.gap.a, s.gap.c, Tick(s.in_at), s.gap.persistent)
            for s in sorted(plan, key=lambda s: (s.gap.a, s.gap.c, s.gap.block))
        )
    )


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
    a = np.array([g.a for g in every], np.int64)
    c = np.array([g.c for g in every], np.int64)
    size = np.array([g.size for g in every], np.int64)
    wraps = c <= a
    spans = [_ideal_span(tl, g) for g in every]
    lo = np.array([sp[0] for sp in spans], np.int64)
    hi = np.array([sp[1] for sp in spans], np.int64)
    free = np.ones(len(every), bool)
    chosen: list[Gap] = []
    scheduled: list[_Scheduled] = []
    away = np.zeros(tl.ticks, np.int64)
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
            best: tuple[int, int] | None = None
            before = int(np.maximum(excess, 0).sum())
            for k in ranked[:_BEAM]:
                trial = _schedule(tl, [*chosen, every[k]])
                if trial is None:
                    continue
                left = tl.need - _away(tl, trial)
                if left[t] >= excess[t] or (t and int(left[:t].max()) > 0):
                    continue  # does not lower tick t, or uncovers an earlier one
                removed = before - int(np.maximum(left, 0).sum())
                if rule == "gain":
                    gain = removed
                elif rule == "gain-per-byte":
                    gain = removed * 1024 // every[k].size
                else:  # "engine-first": the swap-outs all done soonest
                    gain = -max(x.out_done for x in trial)
                if best is None or gain > best[0]:
                    best = (gain, k)
            if best is not None:
                pick = best[1]
            else:
                strict = False  # no stall-free way on: cover the rest, simulate charges stalls
        if pick is None:
            pick = ranked[0]
        g = every[pick]
        chosen.append(g)
        free[pick] = False
        if strict:
            got = _schedule(tl, chosen)
            assert got is not None
            scheduled = got
            away = _away(tl, scheduled)
        else:  # away over its whole gap; the swap-in issued as late as the copy allows
            first = 0 if g.wraps else g.a + 1
            s = _Scheduled(g, int(tl.end_of[g.a]), 0, max(min(int(hi[pick]), g.c), first))
            scheduled.append(s)
            away += _away(tl, [_Scheduled(g, s.out_done, 0, g.c)])
    return _to_swaps(scheduled)


def judge(
    it: Iteration, plans: Iterable[SwapPlan], limit: int, out_gbps: float, in_gbps: float
) -> tuple[SwapPlan, Result]:
    """The plan `simulate` likes best: feasible first, then least overhead, then fewest bytes
    moved, then the earliest given."""
    best: tuple[tuple[bool, float, int, int], SwapPlan, Result] | None = None
    for k, p in enumerate(plans):
        r = simulate(it, p, limit, out_gbps, in_gbps)
        key = (not r.feasible, r.overhead, r.out_bytes + r.in_bytes, k)
        if best is None or key < best[0]:
            best = (key, p, r)
    if best is None:
        raise ValueError("no plans to judge")
    return best[1], best[2]


def tidalpool(
    it: Iteration,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    seeds: Iterable[SwapPlan] = (),
) -> SwapPlan:
    """Step 3: the best in simulation of no swaps, the greedy plan under each rule (also with
    every swap-in issued only at the op that needs it: the most frugal timing, for limits where
    early swap-ins would take the room a malloc needs), and `seeds`."""
    mine = [construct(it, limit, out_gbps, in_gbps, rule) for rule in RULES]
    late = [SwapPlan(tuple(replace(s, in_at=s.in_before) for s in p.swaps)) for p in mine]
    return judge(it, [SwapPlan(), *mine, *late, *seeds], limit, out_gbps, in_gbps)[0]
