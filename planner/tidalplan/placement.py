"""Placement: an offset for every buffer so that no two live at once share a byte.

Pure functions of a `Problem`; the only clock is the time budget `solve` is given.

    address
      ▲        ┌──────┐
      │ ┌──────┤  b2  │ ← a run: ticks whose floor (highest top) is one level
      │ │  b1  │      ├───────┐
      │ │      │      │  b3   │ ← another run, lower
      │ │      │      │       │ · · · · · ← the lowest run: the canonical greedy
      └─┴──────┴──────┴───────┴─────────▶ tick   puts a buffer lying inside it there

- `lower_bound`: the peak of live bytes (sizes rounded up to the alignment): no
  placement is lower.
- `smartpool`: SmartPool's best-fit in decreasing size (Zhang et al., III-C), the
  named baseline.
- `greedy`: one rule with one ordering. Rule "canonical" places, again and
  again, the first buffer in the ordering among those that can go lowest (each
  at the highest top below it), MiniMalloc's canonical order without
  backtracking; rule "fit" takes buffers in the ordering and puts each at the
  lowest offset where it fits among the placed ones it meets in time (XLA's
  heap simulator, 2-D best fit).
- `solve`: both rules over several orderings, the best kept; then a few rounds
  of seeded perturbation of the best ordering; then, when the exact search is
  importable, feasibility at the lower bound and between it and the best
  height, under the time budget. It always returns the best placement found.

Touching lifetimes ([a, b) and [b, c)) may share bytes. Heights count every
size rounded up to `Problem.alignment`, so the lower bound never exceeds them.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
from tidalcore.units import Bytes, Offset

from tidalplan.model import Placement, Problem

Array = npt.NDArray[np.int64]
Progress = Callable[[str], None]
Expired = Callable[[], bool]

ORDERINGS = ("length", "size", "area", "start", "conflicts", "contention")
"""Preorders, each a key compared in decreasing priority (ties: the next keys, then input order):
length: longest lifetime first; size: largest first; area: size × lifetime first; start:
earliest allocation first; conflicts: most buffers met in time first; contention: highest peak
of live bytes during the lifetime first (MiniMalloc's "total")."""
RULES = ("canonical", "fit")

FIT_MAX_BUFFERS = 6_000  # "fit" looks up the buffers each one meets: quadratic memory above this
SMARTPOOL_MAX_BUFFERS = 20_000  # SmartPool is quadratic, as the paper's: left out above this
HEURISTIC_WORK = 400_000  # greedy runs of the portfolio: at most max(1, this // n) of them
IMPROVE_WORK = 200_000  # perturbation rounds: at most this // n of them (and IMPROVE_ROUNDS)
IMPROVE_ROUNDS = 256
IMPROVE_MAX_BUFFERS = 20_000
PERTURBATION = 0.05  # noise on a buffer's position in the ordering, as a fraction of n
SEED = 20180131  # the perturbation's random generator: fixed, so plans repeat
_CHECK_EVERY = 1024  # placements between two looks at the deadline
EXACT_SETUP_S = 1e-5  # seconds per buffer the exact search spends before searching (0.9 s
# for 100,000): a query is made only with at least twice that left
_BIG = 1 << 62


Hint = tuple[int, ...] | None
ExactSearch = Callable[[Problem, int, float, Hint], tuple[str, tuple[int, ...] | None]]
"""`tidalplan.exact.search(problem, capacity, time_limit_s, hint)`: feasibility of the
problem at `capacity`: ("feasible", offsets) | ("infeasible", None) | ("timeout", None)."""


# -- arrays -------------------------------------------------------------------------------------


class _Instance:
    """The problem as arrays: lifetimes, sizes rounded up to the alignment, time sections."""

    def __init__(self, problem: Problem) -> None:
        if problem.alignment < 1:
            raise ValueError(f"alignment must be at least 1, got {problem.alignment}")
        a = problem.alignment
        n = len(problem.buffers)
        self.n = n
        self.alignment = a
        self.lo = np.fromiter((b.lower for b in problem.buffers), np.int64, n)
        self.up = np.fromiter((b.upper for b in problem.buffers), np.int64, n)
        raw = np.fromiter((b.size for b in problem.buffers), np.int64, n)
        self.size: Array = -(-raw // a) * a
        # Sections: the ticks between consecutive distinct lifetime ends; buffer i covers
        # sections [sl[i], su[i]). Touching lifetimes cover disjoint sections.
        self.points = np.unique(np.concatenate((self.lo, self.up)))
        self.m = max(len(self.points) - 1, 0)
        self.sl: Array = np.searchsorted(self.points, self.lo).astype(np.int64)
        self.su: Array = np.searchsorted(self.points, self.up).astype(np.int64)

    def load(self) -> Array:
        """Live bytes in each section."""
        delta = np.zeros(self.m + 1, np.int64)
        np.add.at(delta, self.sl, self.size)
        np.add.at(delta, self.su, -self.size)
        return np.cumsum(delta)[: self.m]

    def walls(self) -> npt.NDArray[np.bool_]:
        """Section boundaries no buffer crosses: the problem splits there."""
        crossing = np.zeros(self.m + 1, np.int64)
        np.add.at(crossing, self.sl + 1, 1)
        np.add.at(crossing, self.su, -1)
        wall: npt.NDArray[np.bool_] = np.cumsum(crossing) == 0
        return wall

    def height(self, offsets: Array) -> int:
        return int((offsets + self.size).max()) if self.n else 0


def lower_bound(problem: Problem) -> int:
    """The peak, over time, of live bytes with sizes rounded up to the alignment.

    The distinct lifetime ends, sorted, cut time into sections; each buffer adds
    its size over the sections of its lifetime (a difference array and a prefix
    sum). Touching lifetimes share no section, so they do not add up. O(n log n).
    """
    if problem.alignment < 1:
        raise ValueError(f"alignment must be at least 1, got {problem.alignment}")
    if not problem.buffers:
        return 0
    inst = _Instance(problem)
    return int(inst.load().max())


# -- orderings ----------------------------------------------------------------------------------


def _range_max(values: Array, lo: Array, hi: Array) -> Array:
    """max(values[lo[i]:hi[i]]) for every i (hi > lo): a sparse table, O(m log m)."""
    table = [values]
    span = 1
    while 2 * span <= len(values):
        prev = table[-1]
        table.append(np.maximum(prev[: len(prev) - span], prev[span:]))
        span *= 2
    length = hi - lo
    k = np.floor(np.log2(length)).astype(np.int64)
    out = np.empty(len(lo), np.int64)
    for level in np.unique(k).tolist():
        sel = k == level
        row = table[level]
        out[sel] = np.maximum(row[lo[sel]], row[hi[sel] - (1 << level)])
    return out


def _ranks(inst: _Instance, ordering: str) -> Array:
    """rank[i]: the position of buffer i in the ordering."""
    lo, up, size = inst.lo, inst.up, inst.size
    index = np.arange(inst.n, dtype=np.int64)
    length = up - lo
    if ordering == "length":
        keys: tuple[npt.NDArray[np.generic], ...] = (index, lo, -size, -length)
    elif ordering == "size":
        keys = (index, lo, -size)
    elif ordering == "area":
        keys = (index, lo, -size, -(length.astype(np.float64) * size))
    elif ordering == "start":
        keys = (index, -size, lo)
    elif ordering == "conflicts":
        ends, starts = np.sort(up), np.sort(lo)
        met = (
            inst.n
            - 1
            - np.searchsorted(ends, lo, "right")
            - (inst.n - np.searchsorted(starts, up, "left"))
        )
        keys = (index, lo, -size, -met)
    elif ordering == "contention":
        peak = _range_max(inst.load(), inst.sl, inst.su)
        keys = (index, lo, -size, -length, -peak)
    else:
        raise ValueError(f"unknown ordering {ordering!r} (known: {', '.join(ORDERINGS)})")
    order = np.lexsort(keys)
    rank = np.empty(inst.n, np.int64)
    rank[order] = index
    return rank


def _perturbed(rank: Array, rng: np.random.Generator) -> Array:
    """The ordering with every position moved by Gaussian noise (PERTURBATION × n)."""
    n = len(rank)
    position = rank + rng.normal(0.0, PERTURBATION * n, n)
    order = np.argsort(position, kind="stable")
    out = np.empty(n, np.int64)
    out[order] = np.arange(n, dtype=np.int64)
    return out


# -- rule "canonical" ---------------------------------------------------------------------------


def _canonical(inst: _Instance, rank: Array, expired: Expired | None = None) -> Array | None:
    """Bottom-up: place the best-ranked buffer among those that can go lowest; repeat.

    The floor over time is kept as maximal runs of sections at one level. Only a
    buffer lying wholly inside a run at the lowest level can go lowest; the
    best-ranked such buffer is placed on that floor, which splits the run in
    three. A run that holds no unplaced buffer is raised to its lower neighbour
    and merges with it: no unplaced buffer could have used the bytes below.
    Equivalent to taking, each time, the unplaced buffer with the least
    (highest top among the placed buffers it meets, rank), but without
    revisiting the buffers that a placement lifts. None if `expired()`.
    """
    n, m = inst.n, inst.m
    by_start = np.lexsort((rank, inst.sl))
    s_sl = inst.sl[by_start]
    s_su = inst.su[by_start]
    s_rank = rank[by_start]
    first = np.searchsorted(s_sl, np.arange(m + 1)).tolist()  # first entry starting at >= k
    alive = bytearray(b"\x01") * n
    alive_np = np.frombuffer(alive, np.uint8)
    l_sl, l_su, l_rank = s_sl.tolist(), s_su.tolist(), s_rank.tolist()
    l_buf, l_size = by_start.tolist(), inst.size.tolist()
    wall = inst.walls().tolist()
    offsets = [0] * n
    end: dict[int, int] = {}  # run start -> run end
    start_of: dict[int, int] = {}  # run end -> run start
    level: dict[int, int] = {}  # run start -> floor
    heap: list[tuple[int, int]] = []
    cut = [k for k in range(m + 1) if wall[k]]
    for a, b in itertools.pairwise(cut):  # one run per independent part
        end[a], start_of[b], level[a] = b, a, 0
        heap.append((0, a))
    heapq.heapify(heap)
    left = n
    while left:
        floor, a0 = heapq.heappop(heap)
        if level.get(a0) != floor:
            continue  # stale: the run was split, raised or merged since
        stack = [a0]
        while stack:
            a = stack.pop()
            b = end[a]
            pa, pb = first[a], first[b]
            best = -1
            if pb - pa < 48:
                best_rank = _BIG
                for p in range(pa, pb):
                    if alive[p] and l_su[p] <= b and l_rank[p] < best_rank:
                        best_rank, best = l_rank[p], p
            else:
                fits = (s_su[pa:pb] <= b) & (alive_np[pa:pb] != 0)
                ranks = np.where(fits, s_rank[pa:pb], _BIG)
                k = int(ranks.argmin())
                if ranks[k] != _BIG:
                    best = pa + k
            del end[a], start_of[b], level[a]
            if best < 0:  # nothing fits: raise the run onto its lower neighbour
                new = min(
                    level[start_of[a]] if not wall[a] else _BIG,
                    level[b] if not wall[b] else _BIG,
                )
                if new == _BIG:
                    continue  # a whole independent part, all placed
                na, nb = a, b
                if not wall[a] and level[start_of[a]] == new:
                    na = start_of.pop(a)
                    del end[na]
                if not wall[b] and level[b] == new:
                    nb = end.pop(b)
                    del start_of[nb], level[b]
                end[na], start_of[nb], level[na] = nb, na, new
                heapq.heappush(heap, (new, na))
                continue
            alive[best] = 0
            left -= 1
            if expired is not None and left % _CHECK_EVERY == 0 and expired():
                return None
            i, x0, x1 = l_buf[best], l_sl[best], l_su[best]
            offsets[i] = floor
            top = floor + l_size[i]
            if a < x0:
                end[a], start_of[x0], level[a] = x0, a, floor
                stack.append(a)
            if x1 < b:
                end[x1], start_of[b], level[x1] = b, x1, floor
                stack.append(x1)
            na, nb = x0, x1
            if x0 == a and not wall[a] and level[start_of[a]] == top:
                na = start_of.pop(a)
                del end[na]
            if x1 == b and not wall[b] and level[b] == top:
                nb = end.pop(b)
                del start_of[nb], level[b]
            end[na], start_of[nb], level[na] = nb, na, top
            heapq.heappush(heap, (top, na))
    return np.array(offsets, np.int64)


# -- rule "fit" ---------------------------------------------------------------------------------


def _neighbours(inst: _Instance) -> list[npt.NDArray[np.intp]]:
    """For every buffer, the others it meets in time (quadratic: FIT_MAX_BUFFERS)."""
    lo, up = inst.lo, inst.up
    out = []
    for i in range(inst.n):
        meets = (lo < up[i]) & (up > lo[i])
        meets[i] = False
        out.append(np.flatnonzero(meets))
    return out


def _fit(
    inst: _Instance,
    rank: Array,
    neighbours: Sequence[npt.NDArray[np.intp]],
    expired: Expired | None = None,
) -> Array | None:
    """In rank order, each buffer at the lowest offset clear of the placed buffers it meets."""
    n, size = inst.n, inst.size
    offsets = np.zeros(n, np.int64)
    placed = np.zeros(n, np.bool_)
    for count, i in enumerate(np.argsort(rank).tolist()):
        if expired is not None and count % _CHECK_EVERY == _CHECK_EVERY - 1 and expired():
            return None
        near = neighbours[i]
        near = near[placed[near]]
        offset = 0
        if len(near):
            bottoms = offsets[near]
            order = np.argsort(bottoms, kind="stable")
            bottoms = bottoms[order]
            tops = np.maximum.accumulate(bottoms + size[near][order])
            # Gaps: [0, bottoms[0]), [tops[k-1], bottoms[k]), [tops[-1], inf).
            gap_lo = np.concatenate(([0], tops))
            gap_hi = np.concatenate((bottoms, [_BIG]))
            offset = int(gap_lo[np.flatnonzero(gap_hi - gap_lo >= size[i])[0]])
        offsets[i] = offset
        placed[i] = True
    return offsets


# -- SmartPool ----------------------------------------------------------------------------------


def smartpool(problem: Problem) -> Placement:
    """SmartPool's placement (Zhang et al., Section III-C; best fit, its default).

    Buffers in decreasing size (ties: earlier allocation first, as the authors'
    code). Each takes the smallest hole that holds it among the bytes its
    already placed neighbours in time leave free: the holes between their merged
    ranges and below the lowest (ties: the lowest hole); with no such hole it
    goes on top of its highest neighbour, extending the pool if need be. (The
    authors' code, onlineColoring's BFallocation, skips the hole below the
    lowest range once there are two ranges; the paper does not, nor does this.)
    Quadratic, as the paper's: every earlier buffer is looked at.
    """
    inst = _Instance(problem)
    n, lo, up, size = inst.n, inst.lo, inst.up, inst.size
    order = np.lexsort((np.arange(n), lo, -size)).tolist()
    offsets = np.zeros(n, np.int64)
    p_lo = lo[order]
    p_up = up[order]
    p_bottom = np.zeros(n, np.int64)
    p_top = np.zeros(n, np.int64)
    for k, i in enumerate(order):
        meets = (p_lo[:k] < up[i]) & (p_up[:k] > lo[i])
        offset = 0
        if meets.any():
            bottoms = p_bottom[:k][meets]
            order_b = np.argsort(bottoms, kind="stable")
            bottoms = bottoms[order_b]
            tops = np.maximum.accumulate(p_top[:k][meets][order_b])
            # Merged ranges touch or overlap; a hole is the space between two of them,
            # or below the first.
            hole_lo = np.concatenate(([0], tops[:-1]))
            hole_size = bottoms - hole_lo
            fits = np.flatnonzero(hole_size >= size[i])
            best = fits[np.argmin(hole_size[fits])] if len(fits) else -1
            offset = int(hole_lo[best]) if len(fits) else int(tops[-1])
        offsets[i] = offset
        p_bottom[k] = offset
        p_top[k] = offset + size[i]
    return Placement(
        offsets=tuple(Offset(int(o)) for o in offsets.tolist()),
        height=Bytes(inst.height(offsets)),
        solver="smartpool",
        optimal=False,
    )


# -- one greedy, and the solver -----------------------------------------------------------------


def greedy(problem: Problem, rule: str = "canonical", ordering: str = "length") -> Placement:
    """One rule ("canonical" or "fit") with one ordering (see ORDERINGS)."""
    inst = _Instance(problem)
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r} (known: {', '.join(RULES)})")
    rank = _ranks(inst, ordering)
    fit = rule == "fit"
    offsets = _fit(inst, rank, _neighbours(inst)) if fit else _canonical(inst, rank)
    assert offsets is not None  # no deadline: never abandoned
    height = inst.height(offsets)
    return Placement(
        offsets=tuple(Offset(int(o)) for o in offsets.tolist()),
        height=Bytes(height),
        solver=f"{rule}/{ordering}",
        optimal=height == lower_bound(problem),
    )


def _import_search() -> ExactSearch | None:
    try:
        from tidalplan.exact import search
    except ImportError:
        return None
    return search


def time_left(time_limit_s: float, budget_s: float | None, started: float) -> float:
    """A placement solve's time limit within a whole plan's budget: `time_limit_s`, or what is
    left of `budget_s` seconds since `started` (time.monotonic) when that is less; at 0, `solve`
    makes its first greedy run alone."""
    if budget_s is None:
        return time_limit_s
    return max(0.0, min(time_limit_s, budget_s - (time.monotonic() - started)))


def solve(
    problem: Problem,
    time_limit_s: float = 10.0,
    use_exact: bool = True,
    progress: Progress | None = None,
    *,
    orderings: Sequence[str] = ORDERINGS,
    improve: bool = True,
    search: ExactSearch | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Placement:
    """The lowest placement found within `time_limit_s` seconds.

    1. Both rules with every ordering of `orderings` (rule "fit" up to
       FIT_MAX_BUFFERS buffers; at most max(1, HEURISTIC_WORK // n) runs), and
       SmartPool up to SMARTPOOL_MAX_BUFFERS: never worse than the baseline.
    2. With `improve`: seeded perturbations of the best greedy run's ordering.
    3. With `use_exact`: the exact search (`search`, else
       `tidalplan.exact.search` when importable): feasible at the lower
       bound proves optimality; else heights between the bound and the best are
       tried, halving the gap.
    Every phase ends once the lower bound is reached. The first greedy run
    always completes; later work stops at the deadline. The same problem and
    options give the same placement whenever the budget is not reached.
    `progress` gets a line for each better placement and each exact query.
    """
    if not time_limit_s >= 0:
        raise ValueError(f"time_limit_s must be a number of seconds >= 0, got {time_limit_s}")
    if not orderings:
        raise ValueError("at least one ordering is needed")
    for ordering in orderings:
        if ordering not in ORDERINGS:
            raise ValueError(f"unknown ordering {ordering!r} (known: {', '.join(ORDERINGS)})")
    start = clock()
    deadline = start + time_limit_s

    def expired() -> bool:
        return clock() >= deadline

    def say(message: str) -> None:
        if progress is not None:
            progress(message)

    inst = _Instance(problem)
    bound = lower_bound(problem)
    stats: dict[str, float] = {"lower_bound": float(bound)}
    if inst.n == 0:
        return Placement((), Bytes(0), "empty", True, {**stats, "seconds": clock() - start})
    best = _Best(inst, bound, say)

    # 1. The portfolio of greedy runs.
    rules = [r for r in RULES if r == "canonical" or inst.n <= FIT_MAX_BUFFERS]
    neighbours = _neighbours(inst) if "fit" in rules else []
    runs = [(rule, o) for o in orderings for rule in rules][: max(1, HEURISTIC_WORK // inst.n)]
    greedy_best = (_BIG, "", np.zeros(0, np.int64))  # height, rule, rank: what improve perturbs
    for count, (rule, ordering) in enumerate(runs):
        rank = _ranks(inst, ordering)
        limit = None if count == 0 else expired
        if rule == "canonical":
            offsets = _canonical(inst, rank, limit)
        else:
            offsets = _fit(inst, rank, neighbours, limit)
        if offsets is None:
            break
        stats["greedy_runs"] = count + 1.0
        height = best.offer(offsets, f"{rule}/{ordering}")
        if height < greedy_best[0]:
            greedy_best = (height, rule, rank)
        if best.height == bound or expired():
            break
    if best.height > bound and inst.n <= SMARTPOOL_MAX_BUFFERS:
        baseline = smartpool(problem)
        best.offer(np.array(baseline.offsets, np.int64), "smartpool")
    stats["greedy_height"] = float(best.height)

    # 2. Perturbations of the best greedy ordering.
    if improve and best.height > bound and inst.n <= IMPROVE_MAX_BUFFERS:
        height, rule, centre = greedy_best
        rng = np.random.default_rng(SEED)
        rounds = min(IMPROVE_ROUNDS, IMPROVE_WORK // inst.n)
        for r in range(rounds):
            if best.height == bound or expired():
                break
            rank = _perturbed(centre, rng)
            if rule == "canonical":
                offsets = _canonical(inst, rank, expired)
            else:
                offsets = _fit(inst, rank, neighbours, expired)
            if offsets is None:
                break
            stats["improve_rounds"] = r + 1.0
            if inst.height(offsets) < height:
                height, centre = best.offer(offsets, f"{rule}+improve"), rank

    # 3. The exact search.
    proven = bound  # no placement is lower than this
    if use_exact and best.height > bound:
        found = search if search is not None else _import_search()
        if found is None:
            say("exact search not available: heuristics only")
        else:
            proven = _exact_phase(problem, inst, found, best, deadline, clock, say, stats)

    stats["seconds"] = clock() - start
    return Placement(
        offsets=tuple(Offset(int(o)) for o in best.offsets.tolist()),
        height=Bytes(best.height),
        solver=best.name,
        optimal=best.height == proven,
        stats=stats,
    )


class _Best:
    """The lowest placement so far; `offer` keeps a lower one and says so."""

    def __init__(self, inst: _Instance, bound: int, say: Progress) -> None:
        self.inst, self.bound, self.say = inst, bound, say
        self.offsets = np.zeros(0, np.int64)
        self.height = _BIG
        self.name = ""

    def offer(self, offsets: Array, name: str) -> int:
        height = self.inst.height(offsets)
        if height < self.height:
            self.offsets, self.height, self.name = offsets, height, name
            ratio = height / self.bound if self.bound else 1.0
            self.say(f"{name}: height {height} ({ratio:.4f} × lower bound)")
        return height


def _exact_phase(
    problem: Problem,
    inst: _Instance,
    search: ExactSearch,
    best: _Best,
    deadline: float,
    clock: Callable[[], float],
    say: Progress,
    stats: dict[str, float],
) -> int:
    """Feasibility at the lower bound, then bisection towards it; returns the proven bound.

    The proven bound rises only on an "infeasible" answer; a timeout sends the
    next try higher without proving anything. An answer the validator refuses
    is dropped. Each query gets half of the time left (the last one, all), if
    that is enough to set the search up.
    """
    from tidalplan.validate import InvalidPlacement, validate

    # Any placement sinks, each buffer onto a top below it or to 0, without rising: the
    # optimum is a sum of sizes, so capacities step by their greatest common divisor.
    a = int(np.gcd.reduce(inst.size))
    bound = proven = floor = best.bound  # floor: the lowest capacity still worth a try
    calls = 0
    while best.height > floor:
        left = deadline - clock()
        if left <= 0.0:
            break
        capacity = bound if calls == 0 else floor + (best.height - a - floor) // (2 * a) * a
        give = left if capacity + a >= best.height else left / 2
        if give < 2 * EXACT_SETUP_S * inst.n:
            say(f"exact: {give:.2f} s left, too little for {inst.n} buffers")
            break
        say(f"exact: capacity {capacity}: searching (up to {give:.1f} s)")
        began = clock()
        hint = tuple(int(o) for o in best.offsets.tolist())
        try:
            status, offsets = search(problem, capacity, give, hint)
        except Exception as e:  # a failing search costs its answer, never the placement
            say(f"exact: capacity {capacity}: the search failed: {type(e).__name__}: {e}")
            break
        calls += 1
        took = clock() - began
        if status == "feasible" and offsets is not None:
            candidate = np.array(offsets, np.int64)
            try:
                height = inst.height(candidate) if len(candidate) == inst.n else -1
                answer = Placement(tuple(Offset(int(o)) for o in offsets), Bytes(height), "exact")
                validate(problem, answer, capacity)
            except InvalidPlacement as e:
                say(f"exact: capacity {capacity}: answer refused by the validator: {e}")
                break
            say(f"exact: capacity {capacity}: feasible ({took:.2f} s)")
            best.offer(candidate, "exact")
            if capacity == bound:
                break  # optimal
        elif status == "infeasible":
            say(f"exact: capacity {capacity}: infeasible ({took:.2f} s)")
            proven = floor = capacity + a
        else:
            say(f"exact: capacity {capacity}: {status} ({took:.2f} s)")
            floor = capacity + a  # unknown below: look higher, prove nothing
    stats["exact_calls"] = float(calls)
    return proven
