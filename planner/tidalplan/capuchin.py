"""Capuchin (Peng et al., ASPLOS 2020) as a plan: per tensor, from the measured access
pattern, swap or recompute the tensors live at the memory peak.

    measured  ─[ev]──────────────── peak ───────────────[back]─▶ op times with no limit
    swap       └[out]┐ ◀──────── FT ────────▶ ┌──[in]──┘   in-trigger: the op at which
                     swap-out ends   swap-in must start      the swap-in is issued
    recompute  ───── dropped after ev ────── writers again ─┘ right before back

The paper is not quoted verbatim here; the rules, paraphrased from its Section 4:

- Eviction candidates are the tensors accessed more than once that are resident at the peak
  memory; the memory to save is the peak usage minus the budget. A candidate leaves after
  its *evicted-access* (its last access before the peak) and is needed back at its
  *back-access* (its first access after it).
- Free Time: FT = SwapInStartTime - SwapOutEndTime, where the swap-out ends its copy time
  after the evicted-access and the swap-in must start its copy time before the back-access
  (later swap-ins queue behind earlier ones: the copy engines are serial).
- MSPS, memory saving per second: the candidate's bytes over its recomputation time, the
  time of the ops that produce it again from tensors still in memory (its lineage, evicted
  tensors recomputed with it). Choosing a tensor for recomputation updates the others' MSPS.
- Hybrid policy: swapping is preferred, since it overlaps compute while recomputation always
  costs compute. Candidates are taken by FT, largest first, for swapping until one cannot be
  fully hidden; then, while memory must still be saved, the candidate with the largest MSPS
  is taken, and it is recomputed when its recomputation overhead is lower than its swap
  overhead (the part of its copies that cannot be hidden), swapped otherwise.
- The swap-in is issued at the in-trigger, the op at which it must start to arrive just in
  time at the back-access; at run time, a back-access that still waits for its swap-in moves
  the in-trigger earlier. Recomputation is on demand, right before the back-access.

Here the measured execution is the iteration with no limit, and after each peak is relieved
the next one is treated the same way, until the estimated usage fits the budget. The run-time
feedback is `simulate`: a few rounds that move late in-triggers one op earlier, the shortest
simulated plan kept. Only transient blocks are evicted. A tensor is recomputed only when its
writers can run again: none draws random numbers or updates a persistent block, and every
tensor they read is recomputed with it or on the device, unchanged, at its back-access.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field, replace
from itertools import accumulate

from tidalcore.units import Tick

from tidalplan.baselines import uses
from tidalplan.learn import live_bytes
from tidalplan.model import Iteration, Recompute, Swap, SwapPlan
from tidalplan.simulate import Result, copy_ns, no_limit, simulate

RANDOM = ("bernoulli", "dropout", "rand", "normal", "uniform")
FEEDBACK_ROUNDS = 8


@dataclass(frozen=True, slots=True)
class Eviction:
    """Block `block` (an `Iteration.blocks` index) leaves after op `ev` and is back for op
    `back`, by a swap or by recomputation."""

    block: int
    ev: Tick
    back: Tick
    swap: bool


@dataclass(slots=True)
class _Group:
    """The recomputation before one op: the blocks rebuilt, their writers, what they read."""

    rebuilt: set[int]
    writers: set[int]
    reads: set[int]  # transient blocks the writers read that are not rebuilt


@dataclass(slots=True)
class _State:
    evictions: list[Eviction] = field(default_factory=list)
    away: dict[int, list[Eviction]] = field(default_factory=dict)  # block -> its evictions
    groups: dict[int, _Group] = field(default_factory=dict)  # op tick -> its rebuild


class _Model:
    """The measured iteration: op times, accesses, copy times."""

    def __init__(self, it: Iteration, out_gbps: float, in_gbps: float) -> None:
        self.it = it
        self.u = uses(it)
        base = no_limit(it)
        self.start = base.tick_ns  # when each tick happened
        self.ns: dict[int, int] = {int(op.tick): op.duration_ns for op in it.ops}
        self.op_ticks: list[int] = [int(op.tick) for op in it.ops]
        self.out_ns = [copy_ns(b.size, out_gbps) for b in it.blocks]
        self.in_ns = [copy_ns(b.size, in_gbps) for b in it.blocks]
        index = {b.id: i for i, b in enumerate(it.blocks)}
        persistent = {pid for pid, _ in it.persistent}
        self.reads: dict[int, set[int]] = {}  # op tick -> transient blocks it reads
        persistent_reads: dict[int, set[int]] = {}
        self.persistent_written: dict[int, list[int]] = {}
        for a in it.accesses:
            i = index.get(a.block)
            if i is not None and not a.write:
                self.reads.setdefault(a.tick, set()).add(i)
            elif i is None and a.block in persistent:
                if a.write:
                    self.persistent_written.setdefault(a.block, []).append(a.tick)
                else:
                    persistent_reads.setdefault(a.tick, set()).add(a.block)
        self.persistent_reads = persistent_reads
        touches_persistent = {t for ts in self.persistent_written.values() for t in ts}
        names: dict[int, str] = {int(op.tick): op.name for op in it.ops}
        self.replayable = {
            t
            for t in self.ns
            if t not in touches_persistent and not any(w in names[t] for w in RANDOM)
        }
        self.live = live_bytes(it).tolist() if it.ticks else [0]
        self.persistent_bytes = sum(size for _, size in it.persistent)

    def end(self, tick: int) -> int:
        return self.start[tick] + self.ns[tick]

    def writers(self, b: int, ev: int) -> list[int] | None:
        """The ops that wrote b up to its evicted-access, None when one cannot run again."""
        block = self.it.blocks[b]
        ws = sorted(int(t) for t in self.u.writes[b] if block.start <= t <= ev)
        return ws if ws and all(w in self.replayable for w in ws) else None

    def op_at_or_before(self, time: int, after: int, until: int) -> int:
        """The last op tick in (after, until] that starts by `time`; the first one if none."""
        k = bisect_right(self.op_ticks, after)
        best = self.op_ticks[k]
        while k < len(self.op_ticks) and self.op_ticks[k] <= until:
            if self.start[self.op_ticks[k]] > time:
                break
            best = self.op_ticks[k]
            k += 1
        return best


def _schedule(m: _Model, swaps: list[Eviction]) -> dict[Eviction, tuple[int, int]]:
    """(swap-out end, latest swap-in start) of each swap on the serial engines, as measured."""
    out_end: dict[Eviction, int] = {}
    free = 0
    for e in sorted(swaps, key=lambda e: (e.ev, e.block)):
        free = max(free, m.end(e.ev)) + m.out_ns[e.block]
        out_end[e] = free
    out: dict[Eviction, tuple[int, int]] = {}
    later = 1 << 62
    for e in sorted(swaps, key=lambda e: (e.back, e.block), reverse=True):
        later = min(later, m.start[e.back]) - m.in_ns[e.block]
        out[e] = (out_end[e], later)
    return out


def _unhidden(sched: dict[Eviction, tuple[int, int]]) -> int:
    """The copy time the swaps cannot hide: the sum of the negative free times."""
    return sum(max(0, out_end - in_start) for out_end, in_start in sched.values())


def _away_at(state: _State, x: int, t: int) -> Eviction | None:
    return next((e for e in state.away.get(x, ()) if e.ev < t < e.back), None)


def _close(m: _Model, state: _State, t: int, seeds: set[int]) -> _Group | None:
    """The rebuild before op t of `seeds` with the blocks away then that their writers read;
    None when a writer cannot run again there."""
    rebuilt: set[int] = set()
    writers: set[int] = set()
    todo = list(seeds)
    while todo:
        b = todo.pop()
        if b in rebuilt:
            continue
        rebuilt.add(b)
        mine = next(e for e in state.away[b] if e.ev < t <= e.back)
        ws = m.writers(b, mine.ev)
        if ws is None:
            return None
        writers.update(ws)
    reads: set[int] = set()
    for w in writers:
        for p in m.persistent_reads.get(w, ()):
            if any(w <= s < t for s in m.persistent_written.get(p, ())):
                return None
    changed = True
    while changed:  # blocks away at t join the rebuild, with their own writers
        changed = False
        for w in sorted(writers):
            for x in m.reads.get(w, ()):
                if x in rebuilt:
                    continue
                e = _away_at(state, x, t)
                if e is not None:
                    if e.swap:
                        return None
                    sub = _close(m, state, t, rebuilt | {x})
                    if sub is None:
                        return None
                    return sub
                blk = m.it.blocks[x]
                if not blk.start < t < blk.end or any(w <= s < t for s in m.u.writes[x]):
                    return None
                reads.add(x)
    return _Group(rebuilt, writers, reads)


def _cost(m: _Model, g: _Group | None) -> int:
    return 0 if g is None else sum(m.ns[w] for w in g.writers)


def _try_recompute(m: _Model, state: _State, e: Eviction) -> dict[int, _Group] | None:
    """The rebuild groups that change when e is recomputed, None when one cannot run."""
    trial = _State(state.evictions, {**state.away, e.block: [*state.away.get(e.block, []), e]})
    trial.groups = state.groups
    changed: dict[int, _Group] = {}
    old = state.groups.get(e.back)
    g = _close(m, trial, e.back, (old.rebuilt if old else set()) | {e.block})
    if g is None:
        return None
    changed[e.back] = g
    for t, grp in state.groups.items():
        if e.ev < t < e.back and e.block in grp.reads:
            h = _close(m, trial, t, grp.rebuilt)
            if h is None:
                return None
            changed[t] = h
    return changed


def _can_swap(state: _State, e: Eviction) -> bool:
    return not any(e.ev < t < e.back and e.block in g.reads for t, g in state.groups.items())


def _add(state: _State, e: Eviction, groups: dict[int, _Group] | None = None) -> None:
    state.evictions.append(e)
    state.away.setdefault(e.block, []).append(e)
    state.groups.update(groups or {})


def _usage(m: _Model, state: _State) -> list[int]:
    """Estimated device bytes at each tick: a swapped block is away from its swap-out's end to
    its swap-in's latest start, a dropped one from the tick after its evicted-access to its
    back-access."""
    steps = [0] * (len(m.live) + 1)
    sched = _schedule(m, [e for e in state.evictions if e.swap])
    for e in state.evictions:
        first, last = e.ev + 1, int(e.back)  # away over ticks [first, last)
        if e.swap:
            out_end, in_start = sched[e]
            first = max(first, bisect_left(m.start, out_end))
            last = min(last, bisect_left(m.start, in_start))
        if first < last:
            steps[first] -= m.it.blocks[e.block].size
            steps[last] += m.it.blocks[e.block].size
    return [m.persistent_bytes + x + d for x, d in zip(m.live, accumulate(steps), strict=False)]


def _candidates(m: _Model, state: _State, p: int) -> list[Eviction]:
    out = []
    for b, blk in enumerate(m.it.blocks):
        ticks = m.u.ticks[b]
        k = bisect_right(ticks, p)
        if not blk.start < p < blk.end or k == 0 or k == len(ticks) or ticks[k - 1] == p:
            continue
        e = Eviction(b, ticks[k - 1], ticks[k], swap=True)
        if _away_at(state, b, p) is None and blk.start < e.ev:
            out.append(e)
    return out


def _relieve(m: _Model, state: _State, p: int, excess: int) -> bool:
    """The hybrid policy at peak tick p; whether anything was evicted."""
    cands = _candidates(m, state, p)
    swaps = [e for e in state.evictions if e.swap]

    def free_time(e: Eviction) -> int:
        return m.start[e.back] - m.in_ns[e.block] - m.end(e.ev) - m.out_ns[e.block]

    chosen = 0
    taken: set[Eviction] = set()
    for e in sorted(cands, key=lambda e: (-free_time(e), e.block)):
        if chosen >= excess:
            break
        if not _can_swap(state, e):
            continue
        sched = _schedule(m, [*swaps, e])
        if _unhidden(sched) or sched[e][0] > m.start[p]:
            break
        _add(state, e)
        swaps.append(e)
        taken.add(e)
        chosen += m.it.blocks[e.block].size
    rest = [e for e in cands if e not in taken]
    before = _unhidden(_schedule(m, swaps))
    while chosen < excess and rest:
        best: tuple[float, int, Eviction, dict[int, _Group]] | None = None
        for e in rest:
            groups = _try_recompute(m, state, replace(e, swap=False))
            if groups is None:
                continue
            extra = sum(_cost(m, g) - _cost(m, state.groups.get(t)) for t, g in groups.items())
            msps = m.it.blocks[e.block].size / max(extra, 1)
            if best is None or msps > best[0]:
                best = (msps, extra, e, groups)
        if best is None:  # none can be recomputed: swap the one that hides best
            e = min(rest, key=lambda e: (-free_time(e), e.block))
            rest.remove(e)
            if _can_swap(state, e):
                _add(state, e)
                swaps.append(e)
                chosen += m.it.blocks[e.block].size
            continue
        _, extra, e, groups = best
        rest.remove(e)
        swap_overhead: float = float("inf")
        if _can_swap(state, e):
            sched = _schedule(m, [*swaps, e])
            swap_overhead = _unhidden(sched) - before + max(0, sched[e][0] - m.start[p])
        if swap_overhead < extra:
            _add(state, e)
            swaps.append(e)
            before = _unhidden(_schedule(m, swaps))
        else:
            _add(state, replace(e, swap=False), groups)
        chosen += m.it.blocks[e.block].size
    return chosen > 0


def _plan(m: _Model, state: _State) -> SwapPlan:
    """Swaps with their in-triggers; recomputations split at every rebuild that needs a
    dropped block before its back-access."""
    swaps = [e for e in state.evictions if e.swap]
    sched = _schedule(m, swaps)
    out = []
    for e in sorted(swaps, key=lambda e: (e.ev, e.block)):
        at = m.op_at_or_before(sched[e][1], e.ev, e.back)
        out.append(Swap(block=e.block, out_after=e.ev, in_before=e.back, in_at=Tick(at)))
    rec = []
    for e in state.evictions:
        if e.swap:
            continue
        cuts = sorted(
            t for t, g in state.groups.items() if e.ev < t < e.back and e.block in g.rebuilt
        )
        previous = int(e.ev)
        for t in [*cuts, e.back]:
            rec.append(Recompute(block=e.block, drop_after=Tick(previous), before=Tick(t)))
            previous = t
    return SwapPlan(tuple(out), tuple(sorted(rec, key=lambda r: (r.before, r.block))))


def _late(m: _Model, plan: SwapPlan, r: Result, in_gbps: float) -> list[int]:
    """Indices of the swaps whose back-access waited for their swap-in."""
    late = []
    for j, s in enumerate(plan.swaps):
        arrived = r.swap_ns[j][1] + copy_ns(m.it.blocks[s.block].size, in_gbps)
        prev = s.in_before - 1
        ready = r.tick_ns[prev] + (m.ns.get(prev, 0)) if prev >= 0 else 0
        if arrived > ready:
            late.append(j)
    return late


def capuchin(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    """Capuchin's plan for `it` under `limit`: nothing when it fits as it is."""
    m = _Model(it, out_gbps, in_gbps)
    state = _State()
    while True:
        use = _usage(m, state)
        p = max(range(len(use)), key=lambda t: (use[t], -t)) if it.ticks else 0
        if not it.ticks or use[p] <= limit or not _relieve(m, state, p, use[p] - limit):
            break
    plan = _plan(m, state)
    r = simulate(it, plan, limit, out_gbps, in_gbps)
    best = (r, plan)
    for _ in range(FEEDBACK_ROUNDS):  # late swap-ins: their in-triggers one op earlier
        late = _late(m, plan, r, in_gbps) if r.feasible else []
        if not late:
            break
        swaps = list(plan.swaps)
        for j in late:
            s = swaps[j]
            k = bisect_right(m.op_ticks, (s.in_at if s.in_at is not None else s.in_before) - 1)
            if k and m.op_ticks[k - 1] > s.out_after:
                swaps[j] = replace(s, in_at=Tick(m.op_ticks[k - 1]))
        plan = replace(plan, swaps=tuple(swaps))
        r = simulate(it, plan, limit, out_gbps, in_gbps)
        if r.feasible and (not best[0].feasible or r.iteration_ns < best[0].iteration_ns):
            best = (r, plan)
    return best[1]
