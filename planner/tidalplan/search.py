"""tidalpool's policy: per block gap, keep, swap or recompute, for the shortest simulated step.

Every gap between two consecutive accesses of a block is a candidate (`gap_cover.gaps`: transient
blocks, persistent ones inside the iteration and across its boundary). A transient gap may also be
*recomputed* (`Recompute`) when its block's writers can run again at the gap's end: each block
they read, other than the block itself, is alive there, not written again in between, and pinned
on the device at that op (no candidate that takes it away over the op may be chosen with it).

    ticks     a ─────────────────── c          the gap of block b: op a, then op c
    swap      └─[out]┐        ┌─[in]┘          two copies on the serial engines
    recompute └ drop ·········· [writers of b] rebuilt on the compute stream before c
    keep      ██████████████████████           on the device, nothing to pay

1. `cover`: a program over every column (swap a gap; recompute a block alone or with its
   writers' inputs one or two levels deep, rebuilt together) picks the cheapest set whose bytes
   hold every tick's excess over the limit: a swap costs its two copies' time, a recomputation
   its writers' time (and holds their other outputs as scratch at the op it rebuilds for);
   exclusion rows keep a block's intervals apart and a recomputation's inputs on the device.
   It is solved relaxed and rounded (`_round`), with a swap covering its whole gap or only the
   ticks its copies leave free when the engines are idle, and, up to `_EXACT_COLUMNS` columns,
   as an integer program at its root node; with swaps alone, also relaxed with a swap's
   copies costing per the share of the iteration its gap lasts (`by_span`: long gaps, whose
   copies have room to pass, first); the greedy engine-aware covers of
   `gap_cover.construct` are added, and every plan is judged by `simulate`.
   A plain start holds every transient block away over its longest gap (`_longest`).
2. `_Search`: local search from each feasible start, best first, while the budget lasts, every
   move judged by `simulate` (the step time, then bytes moved), kept when it shortens the
   step, in rounds until none does:
   - retime: swap-ins as late as possible against the simulated timeline less its waits,
     back to back, latest deadline first; with swaps alone, also as early as the plan's
     bytes allow, in deadline order (`eager`: where the in-engine is the bottleneck);
   - repair (an infeasible plan): add the column that holds the most bytes per cost over the
     tick where it got stuck;
   - exchange: a swap for a recomputation of the same gap, a recomputation for another of it
     or for its swap;
   - shift: a column for one, or for several swaps whose copies hide, covering the ticks it is
     needed over at a lower exposed cost;
   - drop: leave a column out;
   - nudge: issue a swap-in its op waited for one op earlier.
3. With swaps alone, `_banned_starts`: the moves end near the columns a start began with, and
   the covers share their largest swaps; so on half the budget more, search again from covers
   that may not take the best plan's largest swap (a new one each time, `_BANS` at most).

Deterministic: the search spends a budget of simulations (`default_budget`: fewer on long
iterations), not of wall-clock time.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.sparse import csc_matrix, csr_matrix
from tidalcore.units import Tick

from tidalplan import highs
from tidalplan.accesses import Accesses, accesses, derived
from tidalplan.gap_cover import (
    RULES,
    Gap,
    _ideal_span,
    _Timeline,
    construct,
    gaps,
)
from tidalplan.model import Iteration, Recompute, Swap, SwapPlan
from tidalplan.simulate import Result, simulate

BUDGET = 320  # simulations a search spends by default, on iterations of up to _BUDGET_TICKS
_BUDGET_TICKS = 8_000  # longer ones get as many simulated ticks in all: fewer simulations
_LEAST = 48  # ... but at least this many
_SIMPLEX = 200_000  # simplex iterations the cover's program may spend
_GAP = 0.1  # the relative gap at which its integer version stops (at the root node)
_EXACT_COLUMNS = 12_000  # the integer version only up to this many columns
_FIRST_ROWS = 64  # its rows at first, and the most it adds per round
_ROUNDS = 3
_WEIGHTS = (1.0,)  # a swap's cost: its copies' time times this
_DEPTHS = (0, 1, 2)  # recomputations: a block alone, and with its writers' inputs this deep
_SHIFTS = 4  # replacements `_Search.shift` tries per column
_BANS = 6  # with swaps alone, restarts from covers without one of the best plan's columns
_BAN_SHARE = 2  # ... on 1 / this of the budget more
_BANNED = 1e3  # what a banned column costs in such a cover, times its own cost


@dataclass(frozen=True, slots=True)
class Redo:
    """Blocks dropped and rebuilt together before op `before`: one rebuild.

    `drops` are (block index, drop_after); the first is the head, whose gap (index `gap`) ends at
    `before`; the others are blocks its writers read, rebuilt with it (each dropped after its own
    last access before `before`)."""

    gap: int  # index into the gaps: the head's
    before: int
    drops: tuple[tuple[int, int], ...]
    ns: int  # the writers' durations, each once
    scratch: int  # bytes of the other blocks the writers write
    pins: tuple[int, ...]  # trace ids of the blocks the writers read, held on the device


def _group(
    it: Iteration, acc: Accesses, head: int, head_a: int, before: int, depth: int
) -> tuple[tuple[tuple[int, int], ...], set[int], set[int]] | None:
    """The blocks rebuilt with block `head` (dropped after `head_a`) before op `before`: its
    writers' transient inputs down to `depth` levels (0: none), each dropped after its last
    access before `before`; with the writers and the pins. None when it cannot run."""
    drops: dict[int, int] = {it.blocks[head].id: head_a}
    frontier = [it.blocks[head].id]
    for _ in range(depth):
        nxt = []
        for pid in frontier:
            i = acc.index[pid]
            b = it.blocks[i]
            for w in acc.written.get(pid, ()):
                if not b.start <= w <= drops[pid]:
                    continue
                for q in acc.reads.get(w, set()):
                    if q in drops or q in acc.persistent or q not in acc.index:
                        continue
                    qb = it.blocks[acc.index[q]]
                    if not qb.start < before < qb.end:
                        continue
                    last = [t for t in acc.touched.get(q, ()) if t < before]
                    if not last:
                        continue
                    if not any(qb.start <= t <= last[-1] for t in acc.written.get(q, ())):
                        continue
                    drops[q] = last[-1]
                    nxt.append(q)
        frontier = nxt
    writers: set[int] = set()
    for pid, a in drops.items():
        b = it.blocks[acc.index[pid]]
        ws = [t for t in acc.written.get(pid, ()) if b.start <= t <= a]
        if not ws:
            return None
        writers.update(ws)
    pins: set[int] = set()
    for w in writers:
        for q in acc.reads.get(w, set()) - drops.keys():
            at = acc.index.get(q)
            alive = q in acc.persistent or (
                at is not None and it.blocks[at].start < before < it.blocks[at].end
            )
            if not alive or any(w <= t < before for t in acc.written.get(q, ())):
                return None
            pins.add(q)
    members = tuple((acc.index[pid], a) for pid, a in drops.items())
    return members, writers, pins


def redos(it: Iteration, every: Sequence[Gap], depths: Sequence[int] = (0,)) -> list[Redo]:
    """The transient gaps that can be recomputed, alone (depth 0) and with their writers'
    inputs down to each of `depths` levels (see the module's docstring)."""
    acc = accesses(it)
    out: list[Redo] = []
    seen: set[tuple[int, tuple[tuple[int, int], ...]]] = set()
    for k, g in enumerate(every):
        if g.persistent:
            continue
        for depth in depths:
            made = _group(it, acc, g.block, g.a, g.c, depth)
            if made is None:
                continue
            drops, writers, pins = made
            if (g.c, drops) in seen or (depth and len(drops) == 1):
                continue
            seen.add((g.c, drops))
            dropped = {it.blocks[i].id for i, _ in drops}
            scratch: set[int] = set()
            for w in writers:
                scratch |= acc.writes.get(w, set()) - dropped
            out.append(
                Redo(
                    k,
                    g.c,
                    drops,
                    sum(acc.durations[w] for w in writers),
                    sum(acc.sizes.get(q, 0) for q in scratch),
                    tuple(sorted(pins)),
                )
            )
    return out


def _spans(g: Gap, c: int) -> bool:
    """Whether gap `g` keeps its block away over op tick `c` (strictly inside the gap)."""
    return (c > g.a or c < g.c) if g.wraps else g.a < c < g.c


class _Candidates:
    """The gaps and the recomputations, with the pairs that exclude each other.

    Column j < len(gaps) swaps gap j; column len(gaps) + r recomputes `redo[r]`."""

    def __init__(
        self, it: Iteration, out_gbps: float, in_gbps: float, depths: Sequence[int]
    ) -> None:
        self.it = it
        self.gaps = gaps(it, out_gbps, in_gbps)
        self.redo = redos(it, self.gaps, depths)
        self.redo_by_gap: dict[int, list[int]] = {}
        for j, r in enumerate(self.redo):
            self.redo_by_gap.setdefault(r.gap, []).append(j)
        g = len(self.gaps)
        # Per trace block id: (column, lo, hi, wraps) of every interval a column takes it away.
        away: dict[int, list[tuple[int, int, int, bool]]] = {}
        for k, x in enumerate(self.gaps):
            pid = it.persistent[x.block][0] if x.persistent else it.blocks[x.block].id
            away.setdefault(pid, []).append((k, x.a, x.c, x.wraps))
        for j, r in enumerate(self.redo):
            for i, a in r.drops:
                away.setdefault(it.blocks[i].id, []).append((g + j, a, r.before, False))
        clash: set[tuple[int, int]] = set()
        # Rows of the integer program that keep exclusive columns apart, as cliques: at most
        # one of the intervals of a block over any tick (an interval graph: its cliques are at
        # the intervals' first ticks), and a pinned block away from its op only where no
        # recomputation pins it there (one switch z per pin: x_r <= z, z + sum x_away <= 1).
        self.cliques: list[list[int]] = []
        self.pin_rows: list[tuple[list[int], list[int]]] = []  # (pinning columns, away columns)
        for j, r in enumerate(self.redo):
            col = g + j
            for i, a in r.drops:
                for other, lo, hi, wraps in away[it.blocks[i].id]:
                    if other != col and not wraps and lo < r.before and a < hi:
                        clash.add((min(col, other), max(col, other)))
        dropped = {it.blocks[i].id for r in self.redo for i, _ in r.drops}
        for pid in sorted(dropped):
            spans = away[pid]
            for _, lo, _, _ in spans:
                here = sorted({o for o, lo2, hi2, _ in spans if lo2 <= lo < hi2 - 1})
                if len(here) > 1:
                    self.cliques.append(here)
        pinned: dict[tuple[int, int], list[int]] = {}
        for j, r in enumerate(self.redo):
            for p in r.pins:
                pinned.setdefault((p, r.before), []).append(g + j)
        for (p, before), cols in sorted(pinned.items()):
            gone = [
                other
                for other, lo, hi, wraps in away.get(p, ())
                if ((before > lo or before < hi) if wraps else lo < before < hi)
            ]
            if gone:
                self.pin_rows.append((cols, gone))
                clash.update((min(x, y), max(x, y)) for x in cols for y in gone)
        self.cliques = [list(c) for c in dict.fromkeys(tuple(c) for c in self.cliques)]
        self.clash = sorted(clash)
        self.excludes: dict[int, set[int]] = {}
        for u, v in self.clash:
            self.excludes.setdefault(u, set()).add(v)
            self.excludes.setdefault(v, set()).add(u)

    def exclusion(self) -> tuple[csr_matrix, npt.NDArray[np.float64]]:
        """The exclusion rows (rows · x >= lower) over the columns and one switch per pin."""
        m = self.columns
        z = m
        r: list[int] = []
        c: list[int] = []
        v: list[float] = []
        lower: list[float] = []
        for clique in self.cliques:
            k = len(lower)
            r += [k] * len(clique)
            c += clique
            v += [-1.0] * len(clique)
            lower.append(-1.0)
        for pinning, gone in self.pin_rows:
            for x in pinning:
                k = len(lower)
                r += [k, k]
                c += [z, x]
                v += [1.0, -1.0]
                lower.append(0.0)
            k = len(lower)
            r += [k] * (1 + len(gone))
            c += [z, *gone]
            v += [-1.0] * (1 + len(gone))
            lower.append(-1.0)
            z += 1
        rows = csr_matrix((v, (r, c)), shape=(len(lower), z))
        return rows, np.array(lower, np.float64)

    @property
    def columns(self) -> int:
        return len(self.gaps) + len(self.redo)


@dataclass(frozen=True, slots=True)
class _Choice:
    """A plan as columns: swaps with their issue ticks, and recomputations."""

    swaps: tuple[tuple[int, int | None], ...]  # (gap, in_at); None: the simulator's default
    redos: tuple[int, ...]  # indices into the recomputable gaps

    def plan(self, cands: _Candidates) -> SwapPlan:
        swaps = []
        for k, at in self.swaps:
            g = cands.gaps[k]
            swaps.append(Swap(g.block, g.a, g.c, None if at is None else Tick(at), g.persistent))
        recomputes: list[Recompute] = []
        for j in self.redos:
            r = cands.redo[j]
            recomputes.extend(Recompute(i, Tick(a), Tick(r.before)) for i, a in r.drops)
        return SwapPlan(
            tuple(sorted(swaps, key=lambda s: (s.out_after, s.in_before, s.block, s.persistent))),
            tuple(sorted(recomputes, key=lambda r: (r.drop_after, r.before, r.block))),
        )


def _solve(
    cost: npt.NDArray[np.float64],
    spans: highs.Spans,
    need: npt.NDArray[np.float64],
    rows: csr_matrix,
    lower: npt.NDArray[np.float64],
    columns: int = 0,
) -> npt.NDArray[np.float64] | None:
    """min cost·x over x in [0, 1] where the `spans` hold `need` and rows·x >= lower, the first
    `columns` of x binary, by HiGHS within deterministic limits (`_SIMPLEX` simplex iterations;
    for an integer program, its root node and `_GAP`); None when it found no solution."""
    return highs.cover(
        cost,
        spans,
        need,
        rows,
        lower,
        columns,
        simplex_iteration_limit=_SIMPLEX,
        mip_max_nodes=1,
        mip_rel_gap=_GAP,
    )


def _round(
    cands: _Candidates,
    x: npt.NDArray[np.float64],
    cost: npt.NDArray[np.float64],
    coverage: csc_matrix,
    need: npt.NDArray[np.float64],
) -> list[int] | None:
    """Columns for the relaxed solution `x`: every column over one half (no two of them clash:
    the exclusion rows keep their sum at most 1); then, while rows are short, the column that
    covers the most short need per cost, weighted by its x, among those that clash with none
    taken; a swap excluded by taken recomputations may displace them for good. Last, columns no
    row needs are dropped, costliest first. None when some row stays short.

    The greedy is lazy: a column's score only falls as rows fill, so a score computed earlier
    bounds it from above; the heap is scored afresh when a displacement empties rows again."""
    short = need.copy()
    taken: set[int] = set()
    gone: set[int] = set()  # displaced: never taken again
    g = len(cands.gaps)
    ptr, idx, val = coverage.indptr, coverage.indices, np.maximum(coverage.data, 0.0)
    weight = (0.1 + x) / cost

    def scores() -> npt.NDArray[np.float64]:
        covered = np.minimum(np.maximum(short[idx], 0.0), val)
        sums = np.add.reduceat(np.append(covered, 0.0), ptr[:-1]) * (ptr[1:] > ptr[:-1])
        made: npt.NDArray[np.float64] = sums * weight
        return made

    def score(j: int) -> float:
        lo, hi = ptr[j], ptr[j + 1]
        return float(np.minimum(np.maximum(short[idx[lo:hi]], 0.0), val[lo:hi]).sum() * weight[j])

    def put(j: int, sign: float) -> None:
        lo, hi = ptr[j], ptr[j + 1]
        short[idx[lo:hi]] -= sign * coverage.data[lo:hi]

    def fresh() -> list[tuple[float, int]]:
        every = scores()
        heap = [
            (-float(every[j]), j)
            for j in np.flatnonzero(every > 0).tolist()
            if j not in taken and j not in gone
        ]
        heapq.heapify(heap)
        return heap

    for j in np.flatnonzero(x > 0.5 + 1e-6).tolist():
        put(j, 1.0)
        taken.add(j)
    heap = fresh()
    blocked: list[int] = []  # popped while a taken column excludes them
    while (short > 1e-9).any():
        best = -1
        while heap:
            _, j = heapq.heappop(heap)
            if j in taken or j in gone:
                continue
            v = score(j)
            if v <= 0:
                continue
            if heap and -v > heap[0][0]:  # stale: below another's bound
                heapq.heappush(heap, (-v, j))
                continue
            if cands.excludes.get(j, set()) & taken:
                blocked.append(j)
                continue
            best = j
            break
        if best < 0:  # none fits beside the taken: a swap may displace recomputations
            swaps = [(score(j), j) for j in blocked if j < g and j not in gone]
            swaps = [(v, j) for v, j in swaps if v > 0]
            if not swaps:
                return None
            _, best = max(swaps, key=lambda p: (p[0], -p[1]))
            for k in sorted(cands.excludes.get(best, set()) & taken):
                put(k, -1.0)
                taken.discard(k)
                gone.add(k)
            put(best, 1.0)
            taken.add(best)
            heap, blocked = fresh(), []
            continue
        put(best, 1.0)
        taken.add(best)
    for j in sorted(taken, key=lambda j: (-cost[j], j)):
        lo, hi = ptr[j], ptr[j + 1]
        rows, vals = idx[lo:hi], coverage.data[lo:hi]
        if (short[rows] + vals <= 1e-9).all():
            short[rows] += vals
            taken.discard(j)
    return sorted(taken)


def cover(
    cands: _Candidates,
    tl: _Timeline,
    weight: float,
    with_copies: bool,
    exact: bool,
    by_span: bool = False,
    banned: Sequence[int] = (),
) -> _Choice | None:
    """The cheapest columns whose bytes hold every tick's excess (see the module's docstring);
    None when HiGHS finds none within its node limit. `by_span`: a swap's copies cost per the
    share of the iteration its gap lasts (the fewest copy seconds per bytes-time away), so
    that long gaps, whose copies have the most room to pass, are preferred. `banned`: columns
    that cost `_BANNED` times as much (taken only where nothing else holds the bytes)."""
    n = tl.ticks
    every = cands.gaps
    a = np.array([g.a for g in every], np.int64)
    c = np.array([g.c for g in every], np.int64)
    wraps = c <= a
    size = np.array([g.size for g in every], np.int64)
    copies = np.array([g.out_ns + g.in_ns for g in every], np.float64)
    if by_span:
        span = tl.start[c] - tl.end_of[a] + np.where(wraps, tl.total, 0)
        copies = copies * tl.total / np.maximum(span, 1)
    if with_copies:
        ideal = [_ideal_span(tl, g) for g in every]
        lo = np.array([s[0] for s in ideal], np.int64)
        hi = np.array([s[1] for s in ideal], np.int64)
    else:
        lo, hi = a + 1, c.copy()
    r_lo = np.array([d[1] + 1 for r in cands.redo for d in r.drops], np.int64)
    r_hi = np.array([r.before for r in cands.redo], np.int64)
    r_scratch = np.array([r.scratch for r in cands.redo], np.int64)
    lo, hi = np.clip(lo, 0, n), np.clip(hi, 0, n)
    cuts = np.unique(np.concatenate(([0, n], lo, hi, r_lo, r_hi, np.minimum(r_hi + 1, n))))
    seg_start = cuts[:-1]
    worst = np.maximum.reduceat(tl.need, seg_start)
    # A rebuild's scratch lands on the segment of its op, which is that op alone.
    scratch_seg = np.searchsorted(seg_start, r_hi, side="right") - 1
    needed = (worst > 0).copy()
    needed[scratch_seg[(r_scratch > 0) & (worst[scratch_seg] > -r_scratch)]] = True
    rows_needed = np.flatnonzero(needed)
    row_of = np.full(len(seg_start), -1, np.int64)
    row_of[rows_needed] = np.arange(len(rows_needed))
    # Every column as intervals of ticks [first, last) with a value (bytes it holds there).
    g = len(every)
    blocks = cands.it.blocks
    ks = np.arange(g, dtype=np.int64)
    c_parts = [ks, ks[wraps]]
    f_parts = [lo, np.zeros(int(wraps.sum()), np.int64)]
    l_parts = [np.where(wraps, n, hi), hi[wraps]]
    v_parts = [size.astype(np.float64), size[wraps].astype(np.float64)]
    drops = [
        (g + j, d + 1, r.before, int(blocks[i].size))
        for j, r in enumerate(cands.redo)
        for i, d in r.drops
    ]
    drops += [
        (g + j, r.before, r.before + 1, -r.scratch) for j, r in enumerate(cands.redo) if r.scratch
    ]
    if drops:
        more = np.array(drops, np.int64).reshape(-1, 4)
        c_parts.append(more[:, 0])
        f_parts.append(more[:, 1])
        l_parts.append(more[:, 2])
        v_parts.append(more[:, 3].astype(np.float64))
    col_a, first_a = np.concatenate(c_parts), np.concatenate(f_parts)
    last_a, value_a = np.concatenate(l_parts), np.concatenate(v_parts)
    # ... as ranges of the rows (the segments that need bytes), spread for the coverage.
    r0 = np.searchsorted(rows_needed, np.searchsorted(seg_start, first_a))
    r1 = np.searchsorted(rows_needed, np.searchsorted(seg_start, last_a))
    count = np.maximum(r1 - r0, 0)
    row = np.repeat(r0 - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
    m = cands.columns
    need = worst[rows_needed].astype(np.float64)
    scale = float(size.max())
    need = need / scale
    coverage = csc_matrix(
        (np.repeat(value_a / scale, count), (row, np.repeat(col_a, count))),
        shape=(len(rows_needed), m),
    )
    exclusion, floor = cands.exclusion()
    redo_ns = np.array([r.ns for r in cands.redo], np.float64)
    cost = np.concatenate((weight * copies, redo_ns)) + 1.0
    cost[np.asarray(banned, np.int64)] *= _BANNED
    cost = cost / float(cost.max())
    cost = np.concatenate((cost, np.zeros(exclusion.shape[1] - m)))
    # The integer program by row generation: the rows of the largest excess first, then the
    # rows its solution leaves short, `_ROUNDS` times at most; `_round` repairs what is left.
    active = np.sort(np.argsort(-need, kind="stable")[: _FIRST_ROWS if exact else len(need)])
    solution = None
    for _ in range(_ROUNDS if exact else 1):
        spans = highs.Spans(
            col_a, np.searchsorted(active, r0), np.searchsorted(active, r1), value_a / scale
        )
        solution = _solve(cost, spans, need[active], exclusion, floor, m if exact else 0)
        if solution is None:
            return None
        short = need - coverage @ np.round(solution[:m])
        missing = np.flatnonzero(short > 1e-9)
        if not len(missing):
            break
        worst_first = missing[np.argsort(-short[missing], kind="stable")][:_FIRST_ROWS]
        active = np.union1d(active, worst_first)
    assert solution is not None
    picked = _round(cands, solution[:m], cost[:m], coverage, need)
    if picked is None:
        return None
    swaps: list[tuple[int, int | None]] = []
    for k in picked:
        if k < g:
            gap = every[k]
            first = 0 if gap.wraps else gap.a + 1
            at = max(min(int(hi[k]), gap.c), first) if with_copies else None
            swaps.append((k, at))
    return _Choice(tuple(swaps), tuple(k - g for k in picked if k >= g))


def _from_plan(cands: _Candidates, plan: SwapPlan) -> _Choice:
    """The columns of a plan made of the candidates' gaps (swaps only)."""
    where = {(g.persistent, g.block, g.a, g.c): k for k, g in enumerate(cands.gaps)}
    return _Choice(
        tuple(
            (where[(s.persistent, s.block, s.out_after, s.in_before)], s.in_at) for s in plan.swaps
        ),
        (),
    )


def _longest(cands: _Candidates) -> _Choice:
    """Every transient block away over its longest gap: a plain start that holds where a cover
    cannot be found (the activations, out after their forward use, back for the backward)."""
    best: dict[int, int] = {}
    for k, g in enumerate(cands.gaps):
        if g.persistent or g.wraps:
            continue
        held = best.get(g.block)
        if held is None or g.c - g.a > cands.gaps[held].c - cands.gaps[held].a:
            best[g.block] = k
    return _Choice(tuple((k, None) for k in sorted(best.values())), ())


Key = tuple[int, int, int, int]


class _Search:
    """Plans judged by `simulate` within a budget of simulations."""

    def __init__(
        self,
        it: Iteration,
        limit: int,
        out_gbps: float,
        in_gbps: float,
        cands: _Candidates,
        budget: int,
        progress: Callable[[float], None] | None,
        total: int | None = None,
        deadline: float | None = None,
    ) -> None:
        self.it, self.limit, self.out_gbps, self.in_gbps = it, limit, out_gbps, in_gbps
        self.deadline = deadline  # time.monotonic() past which nothing more is judged
        self.cands = cands
        self.budget = budget  # simulations allowed until now
        self.total = budget if total is None else total  # ... in all: what progress counts
        self._columns(_Timeline(it, limit))
        self.dur = np.zeros(it.ticks, np.int64)
        for op in it.ops:
            self.dur[op.tick] = op.duration_ns
        self.spent = 0
        self.progress = progress
        self.best: tuple[Key, _Choice, Result] | None = None  # where the moves start
        self.top: tuple[Key, _Choice, Result] | None = None  # the best of every start's
        self.seen: dict[_Choice, Key] = {}

    def _columns(self, tl: _Timeline) -> None:
        """Per column: the ticks [lo, hi) it takes its (head) block away over (wrapping when
        hi <= lo), its bytes there, and its exposed cost: a swap's copy time beyond its gap's
        compute on the no-stall timeline (a copy that can hide costs 1 ns per 1000 of its
        own), a recomputation's writers' time."""
        self.need = tl.need
        g = len(self.cands.gaps)
        lo, hi, size, exposed = [], [], [], []
        hidden: list[bool] = []
        self.ideal: list[int] = []  # per gap: where its swap-in is issued to arrive in time
        for x in self.cands.gaps:
            first = 0 if x.wraps else x.a + 1
            self.ideal.append(max(min(_ideal_span(tl, x)[1], int(x.c)), first))
            lo.append(x.a + 1)
            hi.append(int(x.c))
            size.append(x.size)
            span = int(tl.start[x.c] - tl.end_of[x.a])
            if x.wraps:
                span += tl.total
            copies = x.out_ns + x.in_ns
            exposed.append(max(copies - span, 0) * 1000 + copies)
            hidden.append(copies <= span)
        for r in self.cands.redo:
            i, a = r.drops[0]
            lo.append(a + 1)
            hi.append(r.before)
            size.append(int(self.it.blocks[i].size))
            exposed.append(r.ns * 1000)
            hidden.append(False)
        self.lo, self.hi = np.array(lo, np.int64), np.array(hi, np.int64)
        self.size = np.array(size, np.int64)
        self.exposed = np.array(exposed, np.int64)
        self.wraps = self.hi <= self.lo
        self.hidden = np.array(hidden, bool)
        assert len(self.lo) == g + len(self.cands.redo)

    def away(self, taken: set[int]) -> npt.NDArray[np.int64]:
        """The bytes the columns `taken` hold away at each tick (head blocks only)."""
        out = np.zeros(len(self.need) + 1, np.int64)
        for col in taken:
            lo, hi, size = int(self.lo[col]), int(self.hi[col]), int(self.size[col])
            if hi > lo:
                out[lo] += size
                out[hi] -= size
            else:
                out[lo] += size
                out[0] += size
                out[hi] -= size
        return np.cumsum(out)[:-1]

    def covering(self, first: int, last: int) -> npt.NDArray[np.int64]:
        """The columns that take their block away over every tick of [first, last]."""
        plain = (self.lo <= first) & (last < self.hi)
        wrapped = self.wraps & ((self.lo <= first) | (last < self.hi))
        return np.flatnonzero(plain | wrapped)

    def left(self) -> bool:
        """Budget left, and time before the deadline."""
        if self.spent >= self.budget:
            return False
        return self.deadline is None or time.monotonic() < self.deadline

    def current(self) -> tuple[Key, _Choice, Result]:
        """The best plan so far (one has been judged)."""
        assert self.best is not None
        return self.best

    def attempt(self, trial: _Choice) -> Key:
        """Judge `trial`, and when it is feasible with swaps, its swap-ins re-timed (late, and
        with swaps alone early)."""
        key, result = self.judge(trial)
        if result is not None and key[0] == 0 and trial.swaps and self.left():
            key = min(key, self.judge(self.retime(trial, result))[0])
            if self.left() and not self.cands.redo:
                key = min(key, self.judge(self.eager(trial))[0])
        return key

    def judge(self, choice: _Choice) -> tuple[Key, Result | None]:
        """Simulate `choice` (once: repeated ones are remembered); keep it if it is the best."""
        if choice in self.seen:
            return self.seen[choice], None
        self.spent += 1
        if self.progress is not None and self.spent % 8 == 0:
            self.progress(min(self.spent / self.total, 1.0))
        r = simulate(self.it, choice.plan(self.cands), self.limit, self.out_gbps, self.in_gbps)
        key: Key = (
            0 if r.feasible else 1,
            0 if r.feasible else -len(r.tick_ns),
            r.iteration_ns,
            r.out_bytes + r.in_bytes,
        )
        self.seen[choice] = key
        if self.best is None or key < self.best[0]:
            self.best = (key, choice, r)
        if self.top is None or key < self.top[0]:
            self.top = (key, choice, r)
        return key, r

    def restart(self, start: tuple[Key, _Choice, Result]) -> None:
        """Search on from `start`, a judged plan, whatever its key (the best so far is kept)."""
        self.best = start

    def retime(self, choice: _Choice, result: Result) -> _Choice:
        """Swap-ins issued as late as possible against the simulated timeline, back to back,
        latest deadline first (so they finish by their ops if the timeline holds)."""
        if not choice.swaps:
            return choice
        ticks = np.array(result.tick_ns, np.int64)
        if len(ticks) < self.it.ticks:
            return choice
        every = self.cands.gaps
        # Each op's deadline: when compute reached it, less its own wait (the wait is what
        # re-timing removes): the previous tick's time and duration.
        ready = np.minimum(ticks, np.concatenate(([0], ticks[:-1] + self.dur[:-1])))
        deadline = np.array([ready[every[k].c] for k, _ in choice.swaps], np.int64)
        copy = np.array([every[k].in_ns for k, _ in choice.swaps], np.int64)
        order = np.argsort(-deadline, kind="stable")
        prefix = np.cumsum(copy[order])
        start_sorted = np.minimum.accumulate(deadline[order] + (prefix - copy[order])) - prefix
        start = np.empty_like(start_sorted)
        start[order] = start_sorted
        issue = np.searchsorted(ticks, start, side="right") - 1
        swaps = []
        for (k, _), at in zip(choice.swaps, issue.tolist(), strict=True):
            g = every[k]
            first = 0 if g.wraps else g.a + 1
            swaps.append((k, max(min(int(at), g.c), first)))
        return _Choice(tuple(swaps), choice.redos)

    def eager(self, choice: _Choice) -> _Choice:
        """Swap-ins issued as soon as the plan's bytes allow, in deadline order: each after the
        last tick of its gap where its block must still be away (the plan's columns, away over
        their whole gaps, hold less than the excess without it). Where the in-engine, not
        compute, is the bottleneck, a swap-in that waits for its issue wastes engine time; the
        simulator holds back one that does not fit yet."""
        if not choice.swaps:
            return choice
        slack = self.away(self.taken(choice)) - self.need
        n = len(self.need)
        earliest: list[int] = []
        for k, _ in choice.swaps:
            g = self.cands.gaps[k]
            first = 0 if g.wraps else g.a + 1
            lo, hi = int(self.lo[k]), int(self.hi[k])
            ticks = np.arange(lo, hi) if hi > lo else np.r_[lo:n, 0:hi]
            held = ticks[slack[ticks] < self.size[k]]
            if not len(held):
                earliest.append(first)
            elif g.wraps and held[-1] >= lo:  # still held before the boundary: from tick 0
                earliest.append(0)
            else:
                earliest.append(min(int(held[-1]) + 1, int(g.c)))
        deadline = [int(self.cands.gaps[k].c) for k, _ in choice.swaps]
        order = sorted(range(len(deadline)), key=lambda i: (deadline[i], i))
        at = [0] * len(deadline)
        latest = 0
        for i in order:
            latest = max(latest, earliest[i])
            at[i] = min(latest, deadline[i])
        swaps = tuple((k, t) for (k, _), t in zip(choice.swaps, at, strict=True))
        return _Choice(swaps, choice.redos)

    def taken(self, choice: _Choice) -> set[int]:
        """The columns of `choice`."""
        g = len(self.cands.gaps)
        return {k for k, _ in choice.swaps} | {g + j for j in choice.redos}

    def fits(self, col: int, taken: set[int]) -> bool:
        """Whether column `col` may join the columns `taken`."""
        return col not in taken and not self.cands.excludes.get(col, set()) & taken

    def cost(self, col: int) -> int:
        """What a column costs when nothing hides it: its copies' or its writers' time."""
        g = len(self.cands.gaps)
        if col < g:
            return self.cands.gaps[col].out_ns + self.cands.gaps[col].in_ns
        return self.cands.redo[col - g].ns

    def repair(self) -> None:
        """An infeasible best: add the column that holds the most bytes per cost over the tick
        where it got stuck (cheapest first among the three best), until one gets further."""
        key, choice, result = self.current()
        if key[0] == 0:
            return
        t = max(len(result.tick_ns) - 1, 0)
        g = len(self.cands.gaps)
        taken = self.taken(choice)
        found: list[tuple[float, int]] = []
        for k, gap in enumerate(self.cands.gaps):
            if _spans(gap, t) and self.fits(k, taken):
                found.append((-gap.size / (self.cost(k) + 1), k))
        for j, r in enumerate(self.cands.redo):
            if r.drops[0][1] < t < r.before and self.fits(g + j, taken):
                size = sum(self.it.blocks[i].size for i, _ in r.drops)
                found.append((-size / (r.ns + 1), g + j))
        for _, col in sorted(found)[:3]:
            if not self.left():
                return
            if col < g:
                trial = _Choice((*choice.swaps, (col, None)), choice.redos)
            else:
                trial = _Choice(choice.swaps, (*choice.redos, col - g))
            if self.judge(trial)[0] < key:
                return

    def drop(self) -> None:
        """Leave out a swap or a recomputation, costliest first, where the step gets shorter
        (a feasible plan stays feasible: the key puts infeasible plans last)."""
        _, choice, _ = self.current()
        g = len(self.cands.gaps)
        cols = sorted(self.taken(choice), key=lambda c: (-self.cost(c), c))
        for col in cols:
            if not self.left():
                return
            choice = self.current()[1]
            if col not in self.taken(choice):
                continue
            if col < g:
                trial = _Choice(tuple(s for s in choice.swaps if s[0] != col), choice.redos)
            else:
                trial = _Choice(choice.swaps, tuple(j for j in choice.redos if j != col - g))
            self.judge(trial)

    def exchange(self) -> None:
        """Turn a swap into a recomputation of the same gap (alone or with its writers'
        inputs), a recomputation into another of the same gap or into a swap of it; swaps by
        copy time and recomputations by their writers' time, costliest first."""
        _, choice, _ = self.current()
        g = len(self.cands.gaps)
        cols = sorted(self.taken(choice), key=lambda c: (-self.cost(c), c))
        for col in cols:
            key, choice, _ = self.current()
            taken = self.taken(choice)
            if col not in taken:
                continue
            gap = col if col < g else self.cands.redo[col - g].gap
            others = [g + j for j in self.cands.redo_by_gap.get(gap, ())]
            if col >= g and not self.cands.gaps[gap].persistent:
                others.insert(0, gap)
            for other in others:
                if not self.left():
                    return
                if other == col or not self.fits(other, taken - {col}):
                    continue
                swaps = tuple(s for s in choice.swaps if s[0] != col)
                redos = tuple(j for j in choice.redos if j != col - g)
                if other < g:
                    trial = _Choice((*swaps, (other, self.ideal[other])), redos)
                else:
                    trial = _Choice(swaps, (*redos, other - g))
                if self.attempt(trial) < key:
                    break

    def shift(self) -> None:
        """Exchange a column for another that covers the ticks it is needed over (where the
        plan holds less than its bytes beyond the excess), with at least the bytes missing
        there, cheapest exposed cost first, `_SHIFTS` tried per column; costliest first."""
        _, choice, _ = self.current()
        g = len(self.cands.gaps)
        cols = sorted(self.taken(choice), key=lambda c: (-int(self.exposed[c]), c))
        for col in cols:
            if not self.left():
                return
            key, choice, _ = self.current()
            taken = self.taken(choice)
            if col not in taken:
                continue
            slack = self.away(taken) - self.need
            lo, hi = int(self.lo[col]), int(self.hi[col])
            ticks = np.arange(lo, hi) if hi > lo else np.r_[lo : len(self.need), 0:hi]
            ticks = ticks[(self.need[ticks] > 0) & (slack[ticks] < self.size[col])]
            if not len(ticks):
                continue
            missing = int((self.size[col] - slack[ticks]).max())
            first, last = int(ticks.min()), int(ticks.max())
            found = [
                int(o)
                for o in self.covering(first, last)
                if self.size[o] >= missing
                and int(self.exposed[o]) < int(self.exposed[col])
                and self.fits(int(o), taken - {col})
            ]
            found.sort(key=lambda o: (int(self.exposed[o]), o))
            swaps = tuple(s for s in choice.swaps if s[0] != col)
            redos = tuple(j for j in choice.redos if j != col - g)
            better = False
            for other in found[:_SHIFTS]:
                if not self.left():
                    return
                if other < g:
                    trial = _Choice((*swaps, (other, self.ideal[other])), redos)
                else:
                    trial = _Choice(swaps, (*redos, other - g))
                if self.attempt(trial) < key:
                    better = True
                    break
            if better or not self.left():
                continue
            # Or several swaps whose copies can hide, largest first, for the bytes missing.
            bundle: list[int] = []
            held = 0
            rest = taken - {col}
            for o in sorted(
                (
                    int(o)
                    for o in self.covering(first, last)
                    if o < g and self.hidden[o] and self.size[o] < missing
                ),
                key=lambda o: (-int(self.size[o]), o),
            ):
                if held >= missing:
                    break
                if self.fits(o, rest):
                    bundle.append(o)
                    rest.add(o)
                    held += int(self.size[o])
            if held >= missing and len(bundle) > 1:
                self.attempt(_Choice((*swaps, *((o, self.ideal[o]) for o in bundle)), redos))

    def nudge(self) -> None:
        """Issue a late swap-in (its op waited for it) one op earlier."""
        key, choice, result = self.current()
        if key[0] != 0 or not choice.swaps or len(result.tick_ns) < self.it.ticks:
            return
        plan = choice.plan(self.cands)
        at = {
            (s.persistent, s.block, s.out_after, s.in_before): k for k, s in enumerate(plan.swaps)
        }
        ops = [int(op.tick) for op in self.it.ops]
        for i, (k, issue) in enumerate(choice.swaps):
            if not self.left():
                return
            gap = self.cands.gaps[k]
            came = result.swap_ns[at[(gap.persistent, gap.block, gap.a, gap.c)]][1]
            if came + gap.in_ns < result.tick_ns[gap.c]:
                continue  # on time
            first = 0 if gap.wraps else gap.a + 1
            now = gap.c - 1 if issue is None else issue
            earlier = [t for t in ops if first <= t < now]
            if not earlier:
                continue
            key, choice, _ = self.current()
            if i >= len(choice.swaps) or choice.swaps[i][0] != k:
                continue
            swaps = (*choice.swaps[:i], (k, earlier[-1]), *choice.swaps[i + 1 :])
            self.judge(_Choice(swaps, choice.redos))

    def improve(self) -> None:
        """Local search from the best plan until the budget is spent or no round of moves
        helps: re-time (late, and with swaps alone early: `eager`; an early swap-in would hold
        bytes a rebuild waits for), repair, exchange, drop, nudge (see the module's
        docstring)."""
        assert self.best is not None
        while self.left():
            key, choice, result = self.best
            if key[0] == 0:
                self.judge(self.retime(choice, result))
                if self.left() and not self.cands.redo:
                    self.judge(self.eager(choice))
            for move in (self.repair, self.exchange, self.shift, self.drop, self.nudge):
                if not self.left():
                    break
                move()
            if not self.best[0] < key:
                break


def _banned_starts(s: _Search, tl: _Timeline) -> None:
    """With swaps alone, while the budget lasts: search again from covers that avoid the best
    plan's largest swap (`_BANS` times, each time the largest of the best plan not yet banned,
    one at a time). Every start's moves end near the columns it began with, and the covers
    share their largest columns, which hold the most bytes: a plan that moves them by other
    gaps, or other blocks, lies beyond any one move."""
    tried: set[int] = set()
    for _ in range(_BANS):
        if not s.left() or s.top is None or s.top[0][0] != 0:
            return
        cols = [k for k, _ in s.top[1].swaps if k not in tried]
        if not cols:
            return
        col = max(cols, key=lambda k: (s.cands.gaps[k].size, -k))
        tried.add(col)
        for by_span in (False, True):
            made = cover(s.cands, tl, 1.0, False, False, by_span=by_span, banned=(col,))
            if made is None or not s.left():
                continue
            key, result = s.judge(made)
            if result is not None and key[0] == 0:
                s.restart((key, made, result))
                s.improve()


def default_budget(it: Iteration) -> int:
    """`BUDGET` simulations for an iteration of up to `_BUDGET_TICKS` ticks; for a longer one,
    as many simulated ticks in all (a simulation's time grows with the ticks), at least
    `_LEAST` simulations."""
    if it.ticks <= _BUDGET_TICKS:
        return BUDGET
    return max(_LEAST, BUDGET * _BUDGET_TICKS // it.ticks)


def search(
    it: Iteration,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    budget: int | None = None,
    progress: Callable[[float], None] | None = None,
    recompute: bool = True,
    deadline: float | None = None,
) -> SwapPlan:
    """The plan with the shortest simulated step found within `budget` simulations (default:
    `default_budget`) for `limit` device bytes; `progress` hears the fraction of the budget
    spent. `recompute=False`: swaps only, for an executor that cannot rebuild blocks, with
    `budget // _BAN_SHARE` simulations more for `_banned_starts`. `deadline`: a
    `time.monotonic()` past which no start is made and no plan judged: the best judged by then
    (none judged: no swaps, which does not fit a limit under the iteration's need)."""
    budget = default_budget(it) if budget is None else budget
    tl = _Timeline(it, limit)
    if tl.ticks == 0 or int(tl.need.max()) <= 0:
        return SwapPlan()
    depths = _DEPTHS if recompute else ()
    # The candidates do not depend on the limit: kept for the next search (`fit` tries several).
    cands = derived(
        it,
        ("search", out_gbps, in_gbps, depths),
        lambda: _Candidates(it, out_gbps, in_gbps, depths),
    )
    budget = max(budget, 1)
    banned = 0 if recompute else budget // _BAN_SHARE
    s = _Search(it, limit, out_gbps, in_gbps, cands, budget, progress, budget + banned, deadline)
    starts: list[_Choice] = []
    kinds = [(False, False), (True, False)]  # (with copies, exact): relaxed and rounded
    if cands.columns <= _EXACT_COLUMNS:
        kinds.append((False, True))
    for weight, (with_copies, exact) in itertools.product(_WEIGHTS, kinds):
        made = cover(cands, tl, weight, with_copies, exact) if s.left() else None
        if made is not None:
            starts.append(made)
    # With swaps alone, covers that prefer long gaps (their copies pass where the engines are
    # free); a recomputation's cost is its writers' time, on no such scale.
    for with_copies in (False, True) if not recompute else ():
        made = cover(cands, tl, 1.0, with_copies, False, by_span=True) if s.left() else None
        if made is not None:
            starts.append(made)
    for rule in RULES if s.left() else ():
        starts.append(_from_plan(cands, construct(it, limit, out_gbps, in_gbps, rule)))
    starts.append(_longest(cands))
    judged: list[tuple[Key, _Choice, Result]] = []
    for choice in starts:
        if s.left():
            key, result = s.judge(choice)
            if result is not None:
                judged.append((key, choice, result))
    if s.top is None:
        return SwapPlan()
    # Local search from every feasible start, best first, while the budget lasts: the moves
    # end in a local optimum near where they begin, and the starts differ in kind.
    judged.sort(key=lambda j: j[0])
    for n, start in enumerate(judged):
        if n and (not s.left() or start[0][0] != 0):
            break
        s.restart(start)
        s.improve()
    if banned:
        s.budget += banned
        _banned_starts(s, tl)
    if progress is not None:
        progress(1.0)
    return s.top[1].plan(cands)
