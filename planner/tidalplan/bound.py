"""A lower bound on the step time of every plan that `simulate` runs under a memory limit.

No plan is made here: the bound is the value of a linear program that every plan
`simulate` runs feasibly satisfies, so it holds for swaps, recomputation and any mix.

    bytes over the limit at tick t                       time ─────────────────────────▶
    compute  ─[ops ≤ a]─ ... ─────────s_t──── ... ──[op c]─[ops after c]─┤ T
    out          └──[out b]──┘ ≤ s_t          │
    in                                        └─[in b]─┘ ≥ s_t, ends before op c
    recompute                                     [writers of b] on the compute stream

Notation: d_o is op o's duration as `simulate` rounds it, C = sum d_o, D(≤t) / D(<t) the
durations of the ops at ticks ≤ t / < t, C(≥t) = C - D(<t). A *gap* g of a block is a run of
ticks the block may be away over: for a transient block, between two consecutive barriers
of [first op after its alloc, its accesses inside its lifetime, last op before its free or
the iteration's end] (away over lo < t < hi); for a persistent block, between consecutive
accesses, and the *wrap* gap from its last access round to its first (t > lo or t < hi);
a persistent block never accessed has one gap over every tick. o_g, i_g = `copy_ns` of the
block at the out / in bandwidth; W(g) = the ops that write the block at ticks in
(alloc, lo], E_t = persistent bytes + `live_bytes`[t] - limit.

The program, over a subset K of the ticks (any subset gives a valid bound; `_pick` takes
the highest excess in each stretch of equal compute and then the highest overall):

    min T  s.t.  T ≥ C;   s_t ≥ D(<t);   s_t' - s_t ≥ D(<t') - D(<t)        (t < t' in K)
      cover   Σ_g min(size_g, E_t) (y_gt + r_gt) ≥ E_t,   y_gt + r_gt ≤ 1,   y, r in [0, 1]
      out     s_t ≥ θ + Σ { o_g y_gt : D(≤lo_g) ≥ θ }        (inner gaps; wrap gaps if t > lo)
      in      T ≥ s_t + φ + Σ { i_g y_gt : C(≥hi_g) ≥ φ }    (inner gaps; wrap gaps if t < hi)
      out'    T - s_t ≥ θ + Σ { o_g y_gt : D(≤lo_g) - D(<t) ≥ θ }    (wrap gaps, t < hi)
      in'     s_t ≥ φ + Σ { i_g y_gt : D(<t) - D(<hi_g) ≥ φ }         (wrap gaps, t > lo)
      rebuild T ≥ s_t + C(≥t) + Σ_g κ_gt r_gt,   κ_gt = size_g Σ_{w in W(g)} d_w / B_wt

for every θ, φ among the gaps' own values (grouped into at most `_BINS` thresholds, each
the smallest value of its group, which only weakens a row); B_wt is the bytes of the gaps
over t that op w writes; r exists only for gaps with W(g) non-empty and when `recompute`.

Why every feasible plan gives a point (T = its `iteration_ns`, s_t = when compute passes
tick t, y_gt = 1 when the block is swapped out at tick t, r_gt = 1 when it is dropped):

1. Compute runs every op once, in tick order from time 0, plus the rebuilds; it ends by
   T. So s_t ≥ D(<t), the ops in [t, t') lie between s_t and s_t', and T ≥ s_t + C(≥t).
2. `simulate` never lets the device exceed the limit: a malloc waits until its bytes fit,
   a swap-in or a rebuild starts only when it fits, and nothing else adds bytes. So right
   after compute passes tick t, the blocks away (swapped out: copy done, swap-in not
   started; dropped: not yet rebuilt) hold at least E_t bytes; for 0/1 values a term
   capped at E_t still covers E_t alone, so the capped row holds too.
3. A block away at tick t left after an op a < t and comes back for an op c > t with no
   access in between (the plan's checks), so t lies in one of its gaps; a block is away
   under one swap or one drop at a time (the plan's intervals do not overlap): y + r ≤ 1.
4. Its swap-out starts when op a has ended, at or after D(≤a) ≥ D(≤lo), and ends by s_t;
   the out engine is serial, so the copies of the blocks away at t that started at or
   after θ fit in [θ, s_t]. Its swap-in starts at or after s_t and ends before op c starts,
   at most T - C(≥c) ≤ T - C(≥hi); the in engine is serial likewise. A persistent block
   away over its wrap gap is away from the iteration's start (its swap-in comes before
   op c ≤ hi: the in row holds for t < hi) or since an op a ≥ lo (the out row, t > lo).
   Its other copy runs in the iteration too (`simulate` ends it when both engines are
   idle): away since the start (t < hi), it goes out again after op lo > t, at or after
   s_t + D(≤lo) - D(<t), and ends by T (out'); away since op lo < t, it came in from time
   0 and ended before op hi < t started, by s_t - (D(<t) - D(<hi)) (in').
5. A dropped block is rebuilt right before op c > t, so after s_t, by its writers, which
   include W(g) (no access lies between lo and the drop). A rebuild runs each writer
   once, so after s_t compute runs every op w that writes a block dropped at t at least
   once more; d_w ≥ Σ {d_w size_g r_gt / B_wt : g over t written by w} since the r are 0/1.

The program's value is certified by its dual: for the row duals that HiGHS returns (signs
cleaned), the Lagrangian Σ y·b + Σ_j min (c - Aᵀy)_j·x_j over each variable's box, with the
unbounded ones (T, s, the running sums of the chains) capped at the program's value V,
bounds min T over every plan with T ≤ V by weak duality, whatever the solver's
tolerances; a plan with T > V is slower than the bound anyway. It is evaluated in
floating point and lowered by more than its rounding error. `ns` is None when an op
touches more than the limit (`profile.op_bound`) or some tick cannot be covered at all
(E_t exceeds the bytes of every gap over it): no plan runs feasibly then.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import highspy
import numpy as np
import numpy.typing as npt
from scipy.sparse import csr_matrix

from tidalplan import highs
from tidalplan.learn import live_bytes
from tidalplan.model import Iteration
from tidalplan.profile import op_bound
from tidalplan.simulate import copy_ns

TICKS = 16  # ticks the program constrains, at most
_BINS = 24  # thresholds per out / in chain
_INNER, _WRAP, _FREE = 0, 1, 2
_OPTIMAL = highspy.HighsModelStatus.kOptimal

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Bound:
    """A lower bound on `iteration_ns` of every plan `simulate` runs feasibly under the limit.

    `ns` is the bound, None when provably no plan fits (`reason` says why).
    """

    ns: int | None
    compute_ns: int  # the ops' durations, as `simulate` rounds them
    program_ns: int  # the linear program's certified value (0 when not solved)
    excess_bytes: int  # the most bytes over the limit at any tick
    ticks: tuple[int, ...] = ()  # the ticks the program constrains
    gaps: int = 0  # gaps the program chose among
    reason: str = ""


@dataclass(frozen=True, slots=True)
class _Gaps:
    """Every gap as arrays (see the module docstring)."""

    kind: I64
    lo: I64
    hi: I64
    size: I64
    out_ns: I64
    in_ns: I64
    release: I64  # D(≤lo): no swap-out of the gap starts earlier
    tail: I64  # C(≥hi): compute left after the swap-in's deadline
    writers: list[list[int]]  # W(g) as op ticks; empty: the gap cannot be recomputed


class _Clock:
    """Durations by tick, as `simulate` rounds them."""

    def __init__(self, it: Iteration, compute_scale: float) -> None:
        dur = np.zeros(max(it.ticks, 1), np.int64)
        for op in it.ops:
            dur[op.tick] = round(op.duration_ns * compute_scale)
        self.dur = dur
        self.upto = np.cumsum(dur)  # D(≤t)
        self.total = int(self.upto[-1])
        self.before = self.upto - dur  # D(<t)
        self.op_ticks = np.array(sorted(op.tick for op in it.ops), np.int64)

    def after(self, t: I64 | int) -> I64:
        """C(≥t)."""
        return self.total - self.before[t]


def _gaps(it: Iteration, clock: _Clock, out_gbps: float, in_gbps: float) -> _Gaps:
    accessed: dict[int, list[int]] = {}
    written: dict[int, list[int]] = {}
    for a in it.accesses:
        accessed.setdefault(a.block, []).append(a.tick)
        if a.write:
            written.setdefault(a.block, []).append(a.tick)
    ops = clock.op_ticks.tolist()
    rows: list[tuple[int, int, int, int]] = []  # kind, lo, hi, size
    writers: list[list[int]] = []
    if not ops:
        return _arrays(rows, writers, clock, out_gbps, in_gbps)
    for b in it.blocks:
        first = int(np.searchsorted(clock.op_ticks, b.start, "right"))
        last = int(np.searchsorted(clock.op_ticks, min(b.end, it.ticks), "left")) - 1
        if first >= last:
            continue
        mine = sorted({t for t in accessed.get(b.id, ()) if b.start < t < b.end})
        points = sorted({ops[first], ops[last], *mine})
        writes = sorted(t for t in written.get(b.id, ()) if b.start < t < b.end)
        for lo, hi in itertools.pairwise(points):
            if hi - lo >= 2:
                rows.append((_INNER, lo, hi, b.size))
                writers.append([w for w in writes if w <= lo])
    for pid, size in it.persistent:
        mine = sorted(set(accessed.get(pid, ())))
        if not mine:
            rows.append((_FREE, -1, it.ticks, size))
            writers.append([])
            continue
        for lo, hi in itertools.pairwise(mine):
            if hi - lo >= 2:
                rows.append((_INNER, lo, hi, size))
                writers.append([])
        if mine[-1] < it.ticks - 1 or mine[0] > 0:
            rows.append((_WRAP, mine[-1], mine[0], size))
            writers.append([])
    return _arrays(rows, writers, clock, out_gbps, in_gbps)


def _arrays(
    rows: list[tuple[int, int, int, int]],
    writers: list[list[int]],
    clock: _Clock,
    out_gbps: float,
    in_gbps: float,
) -> _Gaps:
    a = np.array(rows, np.int64).reshape(-1, 4)
    kind, lo, hi, size = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    inner = kind == _INNER
    wrap = kind == _WRAP
    release = np.where(inner | wrap, clock.upto[np.maximum(lo, 0)], 0)
    tail = np.where(inner | wrap, clock.after(np.minimum(hi, len(clock.dur) - 1)), 0)
    return _Gaps(
        kind,
        lo,
        hi,
        size,
        np.array([copy_ns(s, out_gbps) for s in size.tolist()], np.int64),
        np.array([copy_ns(s, in_gbps) for s in size.tolist()], np.int64),
        release,
        tail,
        writers,
    )


def _over(g: _Gaps, t: int) -> npt.NDArray[np.bool_]:
    """The gaps whose block may be away at tick t."""
    inner = (g.kind == _INNER) & (g.lo < t) & (g.hi > t)
    wrap = (g.kind == _WRAP) & ((g.lo < t) | (g.hi > t))
    out: npt.NDArray[np.bool_] = inner | wrap | (g.kind == _FREE)
    return out


def _coverable(g: _Gaps, ticks: int) -> I64:
    """Bytes of the gaps over each tick."""
    diff = np.zeros(ticks + 1, np.int64)
    inner = g.kind == _INNER
    np.add.at(diff, g.lo[inner] + 1, g.size[inner])
    np.add.at(diff, g.hi[inner], -g.size[inner])
    wrap = g.kind == _WRAP
    diff[0] += int(g.size[wrap].sum())
    np.add.at(diff, g.hi[wrap], -g.size[wrap])
    np.add.at(diff, g.lo[wrap] + 1, g.size[wrap])
    diff[0] += int(g.size[g.kind == _FREE].sum())
    return np.cumsum(diff[:ticks])


def _pick(excess: I64, clock: _Clock, count: int) -> list[int]:
    """Up to `count` ticks over the limit: the highest in each of count/2 stretches of equal
    compute, then the highest of the rest; only plateau maxima of the excess."""
    over = excess > 0
    prev = np.concatenate(([-1], excess[:-1]))
    nxt = np.concatenate((excess[1:], [-1]))
    cand = np.flatnonzero(over & (excess >= prev) & (excess >= nxt))
    if len(cand) <= count:
        return cand.tolist()
    chosen: set[int] = set()
    when = clock.before[cand]
    edges = np.linspace(when[0], when[-1] + 1, count // 2 + 1)
    part = np.searchsorted(edges, when, "right") - 1
    for p in np.unique(part).tolist():
        here = cand[part == p]
        chosen.add(int(here[np.argmax(excess[here])]))
    for t in cand[np.argsort(-excess[cand], kind="stable")].tolist():
        if len(chosen) >= count:
            break
        chosen.add(int(t))
    return sorted(chosen)


class _Program:
    """A sparse LP assembled row by row: min cost·x, row_lo ≤ A x ≤ row_hi, col_lo ≤ x ≤ col_hi."""

    def __init__(self, unit: float) -> None:
        self.unit = unit  # ns per time unit of the program (its coefficients are kept small)
        self.col_lo: list[float] = []
        self.col_hi: list[float] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []
        self.r: list[npt.NDArray[np.int64]] = []
        self.c: list[npt.NDArray[np.int64]] = []
        self.v: list[npt.NDArray[np.float64]] = []

    def cols(self, n: int, lo: float = 0.0, hi: float = 1.0) -> int:
        start = len(self.col_lo)
        self.col_lo += [lo] * n
        self.col_hi += [hi] * n
        return start

    def row(self, cols: npt.ArrayLike, vals: npt.ArrayLike, lo: float, hi: float = math.inf) -> int:
        k = len(self.row_lo)
        self.row_lo.append(lo)
        self.row_hi.append(hi)
        c = np.asarray(cols, np.int64).ravel()
        self.c.append(c)
        self.r.append(np.full(len(c), k, np.int64))
        self.v.append(np.broadcast_to(np.asarray(vals, np.float64), c.shape).copy())
        return k

    def rows(self, cols: I64, vals: npt.NDArray[np.float64], lo: npt.ArrayLike) -> None:
        """One row per line of `cols` / `vals` (same shape, n × m), each ≥ its `lo`."""
        n = cols.shape[0]
        k = len(self.row_lo)
        self.row_lo += np.broadcast_to(np.asarray(lo, np.float64), (n,)).tolist()
        self.row_hi += [math.inf] * n
        self.r.append(np.repeat(np.arange(k, k + n), cols.shape[1]))
        self.c.append(cols.ravel())
        self.v.append(vals.ravel().astype(np.float64))

    def chain(
        self, head: list[tuple[int, float]], cols: I64, coefs: I64, keys: I64, base: float = 0.0
    ) -> None:
        """For every threshold θ among `keys`: Σ head ≥ base + θ + Σ {coefs·cols : keys ≥ θ},
        through running sums Z_b ≥ Z_(b-1) + Σ (the group's coefs·cols), grouped into at
        most `_BINS` thresholds."""
        if len(cols) == 0:
            return
        order = np.argsort(-keys, kind="stable")
        k = keys[order]
        ends = np.flatnonzero(np.concatenate((k[1:] != k[:-1], [True]))) + 1
        if len(ends) > _BINS:
            ends = np.unique(
                np.concatenate((ends[np.linspace(0, len(ends) - 1, _BINS).astype(int)],))
            )
        z = self.cols(len(ends), 0.0, math.inf)
        scaled = coefs / self.unit
        begin = 0
        for b, end in enumerate(ends.tolist()):
            part = order[begin:end]
            zc = [z + b] + ([z + b - 1] if b else [])
            zv = [1.0] + ([-1.0] if b else [])
            self.row(np.concatenate((zc, cols[part])), np.concatenate((zv, -scaled[part])), 0.0)
            hc, hv = zip(*head, strict=True)
            self.row([*hc, z + b], [*hv, -1.0], (base + float(k[end - 1])) / self.unit)
            begin = end

    def matrix(self) -> csr_matrix:
        r, c, v = (np.concatenate(x) for x in (self.r, self.c, self.v))
        return csr_matrix((v, (r, c)), shape=(len(self.row_lo), len(self.col_lo)))


def _solve(p: _Program, cost: npt.NDArray[np.float64]) -> tuple[float, npt.NDArray[np.float64]]:
    """min cost·x by HiGHS: (its value, the row duals); (inf, empty) when not optimal."""
    a = p.matrix()
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = a.shape[1], a.shape[0]
    inf = highspy.kHighsInf
    lp.col_cost_ = cost
    lp.col_lower_ = np.array(p.col_lo)
    lp.col_upper_ = np.minimum(np.array(p.col_hi), inf)
    lp.row_lower_ = np.maximum(np.array(p.row_lo), -inf)
    lp.row_upper_ = np.minimum(np.array(p.row_hi), inf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = a.indptr
    lp.a_matrix_.index_ = a.indices
    lp.a_matrix_.value_ = a.data
    solver = highs.solver()
    solver.passModel(lp)
    solver.run()
    if solver.getModelStatus() != _OPTIMAL:
        return math.inf, np.zeros(0)
    value = float(solver.getInfo().objective_function_value)
    return value, np.asarray(solver.getSolution().row_dual, np.float64)


def _certified(
    p: _Program, cost: npt.NDArray[np.float64], duals: npt.NDArray[np.float64], cap: float
) -> float:
    """Weak duality: a lower bound on min cost·x over the program with every unbounded column
    capped at `cap`, for any row duals (their signs cleaned), lowered by its rounding error."""
    a = p.matrix()
    lo, hi = np.array(p.row_lo), np.array(p.row_hi)
    y = np.where((duals > 0) & np.isfinite(lo), duals, 0.0) + np.where(
        (duals < 0) & np.isfinite(hi), duals, 0.0
    )
    rows = np.where(
        y > 0, y * np.where(np.isfinite(lo), lo, 0.0), y * np.where(np.isfinite(hi), hi, 0.0)
    )
    reduced = cost - a.T @ y
    clo, chi = np.array(p.col_lo), np.minimum(np.array(p.col_hi), cap)
    cols = np.minimum(reduced * clo, reduced * chi)
    terms = np.concatenate((rows, cols))
    value = math.fsum(terms.tolist())
    # float error: each product and each reduced cost is off by a few ulps of its magnitude
    spread = float(np.abs(terms).sum()) + float(
        np.maximum(np.abs(clo), chi) @ (abs(a.T) @ np.abs(y) + np.abs(cost))
    )
    return value - 1e-12 * (spread + 1.0)


def cover_floor(it: Iteration) -> int:
    """The lowest limit at which no op touches more bytes (`profile.op_bound`) and every tick
    can be covered, its bytes over the limit no more than those of the gaps over it (what
    could be away there): under it `step_bound` proves that no plan fits; at or over it, one
    may. The gaps' bytes do not depend on the copies' bandwidth or the ops' times."""
    floor = op_bound(it)
    if not it.ticks:
        return floor
    need = live_bytes(it) + sum(size for _, size in it.persistent)
    g = _gaps(it, _Clock(it, 1.0), 1.0, 1.0)
    return max(floor, int((need - _coverable(g, it.ticks)).max(initial=0)))


def step_bound(
    it: Iteration,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
    recompute: bool = True,
) -> Bound:
    """A lower bound on the iteration time of every plan `simulate` runs feasibly under
    `limit` device bytes (see the module docstring); ns None: no plan fits."""
    if not (0 < out_gbps < math.inf and 0 < in_gbps < math.inf and 0 <= compute_scale < math.inf):
        raise ValueError("bandwidths must be positive and compute_scale non-negative")
    clock = _Clock(it, compute_scale)
    compute = clock.total if it.ticks else 0
    persistent = sum(size for _, size in it.persistent)
    excess = (live_bytes(it) if it.ticks else np.zeros(0, np.int64)) + persistent - limit
    most = int(excess.max(initial=0))
    if op_bound(it) > limit:
        return Bound(None, compute, 0, most, reason="an op touches more bytes than the limit")
    if most <= 0:
        return Bound(compute, compute, 0, 0)
    g = _gaps(it, clock, out_gbps, in_gbps)
    short = np.flatnonzero(_coverable(g, it.ticks) < excess)
    if len(short):
        return Bound(None, compute, 0, most, reason=f"tick {int(short[0])} cannot be covered")
    ticks = _pick(excess, clock, TICKS)
    p, cost, used = _program(g, clock, excess, ticks, recompute)
    value, duals = _solve(p, cost)
    if not math.isfinite(value):
        return Bound(compute, compute, 0, most, ticks=tuple(ticks), gaps=used)
    certified = _certified(p, cost, duals, value) * p.unit
    program = max(0, math.ceil(certified - 1e-9 * abs(certified) - 1e-3))
    return Bound(max(compute, program), compute, program, most, tuple(ticks), used)


def _program(
    g: _Gaps,
    clock: _Clock,
    excess: I64,
    ticks: list[int],
    recompute: bool,
) -> tuple[_Program, npt.NDArray[np.float64], int]:
    total = float(clock.total)
    unit = max(1.0, total)
    p = _Program(unit)
    tcol = p.cols(1, total / unit, math.inf)
    s = p.cols(len(ticks), 0.0, math.inf)
    for k, t in enumerate(ticks):
        p.col_lo[s + k] = float(clock.before[t]) / unit
        if k:
            gap = float(clock.before[t] - clock.before[ticks[k - 1]]) / unit
            p.row([s + k, s + k - 1], [1.0, -1.0], gap)
    over = [np.flatnonzero(_over(g, t)) for t in ticks]
    used = np.unique(np.concatenate(over)) if over else np.zeros(0, np.int64)
    dur = clock.dur.astype(np.float64) / unit
    outs: list[
        tuple[I64, I64]
    ] = []  # per tick: (gaps, their y columns) whose swap-out is before s_t
    ins: list[tuple[I64, I64]] = []  # ... whose swap-in is after s_t
    for k, t in enumerate(ticks):
        idx = over[k]
        n = len(idx)
        ycols = np.arange(n) + p.cols(n)
        size = g.size[idx]
        can = np.array([bool(g.writers[j]) for j in idx.tolist()], bool) & recompute
        rcols = np.arange(int(can.sum())) + p.cols(int(can.sum()))
        p.row(
            np.concatenate((ycols, rcols)),
            np.minimum(np.concatenate((size, size[can])), excess[t]) / float(excess[t]),
            1.0,
        )
        if len(rcols):
            p.rows(np.stack((ycols[can], rcols), axis=1), -np.ones((len(rcols), 2)), -1.0)
        kind, lo, hi = g.kind[idx], g.lo[idx], g.hi[idx]
        out = (kind == _INNER) | ((kind == _WRAP) & (t > lo))
        into = (kind == _INNER) | ((kind == _WRAP) & (t < hi))
        outs.append((idx[out], ycols[out]))
        ins.append((idx[into], ycols[into]))
        # a wrap gap's other copy runs in this iteration too: away since the start, it goes
        # out after its last access lo > t; away since lo < t, it came in before hi < t
        later = (kind == _WRAP) & ~out
        p.chain(
            [(tcol, 1.0), (s + k, -1.0)],
            ycols[later],
            g.out_ns[idx[later]],
            g.release[idx[later]] - clock.before[t],
        )
        earlier = (kind == _WRAP) & ~into
        p.chain(
            [(s + k, 1.0)],
            ycols[earlier],
            g.in_ns[idx[earlier]],
            clock.before[t] - clock.before[hi[earlier]],
        )
        # rebuilds after s_t: each writer's duration spread over the bytes it writes here
        written: dict[int, int] = {}
        for j in idx[can].tolist():
            for w in g.writers[j]:
                written[w] = written.get(w, 0) + int(g.size[j])
        kappa = [
            float(g.size[j]) * sum(dur[w] / written[w] for w in g.writers[j])
            for j in idx[can].tolist()
        ]
        p.row(
            np.concatenate(([tcol, s + k], rcols)),
            np.concatenate(([1.0, -1.0], -np.array(kappa, np.float64))),
            float(clock.after(t)) / unit,
        )
    for k, ((og, oc), (ig, ic)) in enumerate(zip(outs, ins, strict=True)):
        p.chain([(s + k, 1.0)], oc, g.out_ns[og], g.release[og])
        p.chain([(tcol, 1.0), (s + k, -1.0)], ic, g.in_ns[ig], g.tail[ig])
    cost = np.zeros(len(p.col_lo))
    cost[tcol] = 1.0
    return p, cost, len(used)
