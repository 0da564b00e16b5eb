"""Checkmate's optimal rematerialization, as the recomputation-only baseline.

Checkmate (Jain et al., MLSys 2020): "We formalize the problem of trading-off DNN training
time and memory requirements as the tensor rematerialization optimization problem" (the
abstract, verbatim). The program itself, paraphrased (not quoted): for a graph of n ops in
topological order, binary R[t,i] (op i is computed in stage t) and S[t,i] (op i's value is
kept in memory into stage t), with free variables for what leaves memory inside a stage,

    minimize    sum_t sum_i  C_i R[t,i]                   total compute, recomputation included
    subject to  R[t,j] <= R[t,i] + S[t,i]   (i,j) in E    an op's inputs are computed in the
                                                          same stage or kept from before
                S[t+1,i] <= R[t,i] + S[t,i]               only what existed can be kept
                R[t,t] = 1, S[1,.] = 0                    stage t computes op t; start empty
                U[t,k] <= M_budget                        memory after each op of each stage

Here the graph is the trace's and its order is fixed: every op of the iteration runs once at
its tick (R[t,t] = 1). The program decides the project's recomputation model (`Recompute`): a
transient block may be dropped after an access a and rebuilt right before a later op t of
the same gap (a < t <= c, c its next access); the rebuild runs the block's writers again, and
all rebuilds for one op are one rebuild. Its variables and rows:

    r[g,t]  binary  drop gap g after its access a, rebuild it before op t   (S = 0 over (a, t))
    y[w,t]  [0, 1]  op w runs again in the rebuild for op t: y >= r for
                    every candidate w wrote; cost w's duration, once      (R[t,w] and C_w)
    z[p,t]  [0, 1]  scratch for block p, written there and not rebuilt:
                    z >= y[w,t] - r[p's gap, t] for every writer w of p
    sum_t r[g,t] <= 1                                   one drop per gap
    y[w,t] + sum r[g',t'] <= 1  over p's drops covering t, for each block p op w reads
                                                        (R[t,j] <= R[t,i] + S[t,i]); for a p
                                                        not live at t, or written from w on:
                                                        y[w,t] <= r[p's gap, t]
    load(t) - sum s_g r[g,t'] + sum s_p z[p,t] <= limit  at every tick t, over the drops
                                                        covering t (a < t < t'), z at a rebuild

    minimize  sum duration(w) y[w,t]  (+ under 1 ns in all: fewer recomputations on ties)

With no swaps compute never waits (a rebuild or a malloc fits, or the plan is infeasible), so
`simulate`'s iteration time is the baseline plus exactly this objective.

Relaxed or restricted, against Checkmate:
- Memory is counted per tick of the trace, the rebuilt blocks and all the scratch at once for
  the whole rebuild (the project's model): no free variables inside a stage.
- A block is dropped at most once per gap, right after its access (a later drop in the same
  gap only holds it longer for the same rebuild); ops are rebuilt only as writers of a
  dropped block, never on their own.
- Rebuild points: every op of the gap when that makes at most `FULL` candidates (then the
  program expresses every recomputation-only plan of this form). Otherwise the access after
  each gap that spans a tick over the limit, and, up to `_DEPTH` blocks back, that point for
  the blocks its writers read or write that would be away then, so that a chain is rebuilt
  as one (Checkmate likewise keeps to the graph's own stages).
- Memory rows are only written where the load is over the limit, one per stretch of ticks
  covered by the same drops (their highest load); a row whose drops include another's and
  whose load is no higher is left out; the dropped bytes are a running sum over the rows,
  so each drop enters two rows, not every row it spans. None of this loses a plan.

HiGHS solves the integer program (Checkmate's LP rounding is not used). It stops at
`_NODE_LIMIT` branch-and-bound nodes, which is deterministic, or at `time_limit_s`, which is
not: two runs agree unless the clock stops one. `solve` says how it ended (`Remat.status`):
"optimal" is optimal among the plans the program expresses (all of the form above when
`Remat.exhaustive`), "limit" the best found when a limit cut the search short.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Literal

import highspy
import numpy as np
import numpy.typing as npt
from scipy.sparse import csr_matrix
from tidalcore.units import Tick

from tidalplan import highs
from tidalplan.accesses import accesses
from tidalplan.autoswap import load
from tidalplan.model import Iteration, Recompute, SwapPlan

FULL = 2000  # candidates (gap, op) up to which every op of a gap is a rebuild point
_DEPTH = 2  # how far back a chain of blocks rebuilt together may reach, when not every op is
_NODE_LIMIT = 500  # branch-and-bound nodes: the deterministic limit
_UNIT = 1 << 16  # bytes per unit in the memory rows: a byte over stays above the tolerance
_FEASIBLE = 2  # HiGHS' primal_solution_status of a feasible solution

Status = Literal["optimal", "limit", "infeasible", "none"]


@dataclass(frozen=True, slots=True)
class Remat:
    """What the program found. `status`: "optimal" (proven, within 1 ns), "limit" (a limit
    stopped the search; `plan` is its best), "infeasible" (no plan of the program fits; `plan`
    is empty), "none" (a limit stopped it before any plan; `plan` is empty)."""

    plan: SwapPlan
    status: Status
    recompute_ns: int  # the plan's rebuilds' compute
    bound_ns: float  # HiGHS' lower bound on it
    exhaustive: bool  # every op of every gap was a rebuild point
    stats: dict[str, float] = field(default_factory=dict, compare=False)


@dataclass(frozen=True, slots=True)
class _Gap:
    block: int  # index into `Iteration.blocks`
    pid: int  # its trace id
    size: int
    a: int  # the access after which it is dropped
    c: int  # the next access
    writers: tuple[int, ...]  # ticks writing it in [start, a]


class _Trace:
    """The accesses of an iteration, indexed as the simulator reads them."""

    def __init__(self, it: Iteration) -> None:
        ix = accesses(it)
        self.ops, self.duration = ix.op_ticks, ix.durations
        self.reads, self.writes, self.written = ix.reads, ix.writes, ix.written
        self.index, self.persistent, self.size = ix.index, ix.persistent, ix.sizes
        self.gaps: list[_Gap] = []
        self.gaps_of: dict[int, list[int]] = {}  # trace id -> its gaps, in tick order
        for i, b in enumerate(it.blocks):
            mine = sorted({t for t in ix.touched.get(b.id, ()) if b.start < t < b.end})
            for a, c in itertools.pairwise(mine):
                writers = tuple(
                    sorted({t for t in self.written.get(b.id, ()) if b.start <= t <= a})
                )
                if writers:
                    self.gaps_of.setdefault(b.id, []).append(len(self.gaps))
                    self.gaps.append(_Gap(i, b.id, int(b.size), a, c, writers))
        self.blocks = it.blocks

    def gap_at(self, pid: int, t: int) -> int | None:
        """The gap of block `pid` with a < t <= c, if any."""
        mine = self.gaps_of.get(pid, [])
        k = bisect.bisect_left([self.gaps[g].c for g in mine], t)
        return mine[k] if k < len(mine) and self.gaps[mine[k]].a < t else None

    def usable(self, pid: int, w: int, t: int) -> bool:
        """Block `pid`, read by op `w`, is live at op `t` and not written from w until t, so a
        rebuild for t may read it if it is not dropped then (the simulator's rule)."""
        i = self.index.get(pid)
        live = pid in self.persistent or (
            i is not None and self.blocks[i].start < t < self.blocks[i].end
        )
        return live and not any(w <= s < t for s in self.written.get(pid, ()))


def _candidates(
    tr: _Trace, over: npt.NDArray[np.bool_], full_up_to: int
) -> tuple[list[tuple[int, int]], bool]:
    """(gap, rebuild op) pairs the program may choose, and whether every op was offered."""
    ops = tr.ops
    full = sum(bisect.bisect_right(ops, g.c) - bisect.bisect_right(ops, g.a) for g in tr.gaps)
    if full <= full_up_to:
        return [
            (k, t)
            for k, g in enumerate(tr.gaps)
            for t in ops[bisect.bisect_right(ops, g.a) : bisect.bisect_right(ops, g.c)]
        ], True
    counted = np.concatenate(([0], np.cumsum(over)))
    first = {k: g.c for k, g in enumerate(tr.gaps) if counted[g.c] > counted[g.a + 1]}
    chosen = {(k, t) for k, t in first.items()}
    level = sorted(chosen)
    for _ in range(_DEPTH):  # the blocks a rebuild's writers need that may be away then
        found: set[tuple[int, int]] = set()
        for k, t in level:
            for w in tr.gaps[k].writers:
                for pid in sorted(tr.reads.get(w, set()) | tr.writes.get(w, set())):
                    g = tr.gap_at(pid, t)
                    if g is None or (g, t) in chosen:
                        continue
                    gone = pid in tr.reads.get(w, ()) and not tr.usable(pid, w, t)
                    if gone or first.get(g, t) > t:
                        found.add((g, t))
        chosen |= found
        level = sorted(found)
    return sorted(chosen, key=lambda kt: (kt[1], kt[0])), False


def _prune(tr: _Trace, cands: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Leave out candidates a writer of which reads a block that can be neither on the device
    nor rebuilt with it, until none is left to remove."""
    while True:
        have = set(cands)
        keep = []
        for k, t in cands:
            ok = True
            for w in tr.gaps[k].writers:
                for pid in sorted(tr.reads.get(w, ())):
                    if pid == tr.gaps[k].pid or tr.usable(pid, w, t):
                        continue
                    g = tr.gap_at(pid, t)
                    if g is None or (g, t) not in have:
                        ok = False
            if ok:
                keep.append((k, t))
        if len(keep) == len(cands):
            return keep
        cands = keep


class _Program:
    """Rows of the program in triplets; columns numbered as they are made."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.integer: list[bool] = []
        self.col_lower: list[float] = []
        self.col_upper: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []

    def column(self, cost: float, integer: bool, lower: float = 0.0, upper: float = 1.0) -> int:
        self.cost.append(cost)
        self.integer.append(integer)
        self.col_lower.append(lower)
        self.col_upper.append(upper)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        r = len(self.lower)
        for c, v in terms:
            self.rows.append(r)
            self.cols.append(c)
            self.vals.append(v)
        self.lower.append(lower)
        self.upper.append(upper)


def _memory_rows(
    it: Iteration,
    tr: _Trace,
    cands: list[tuple[int, int]],
    over_by: npt.NDArray[np.int64],
    scratch_at: dict[int, list[tuple[int, int]]],
    prog: _Program,
) -> None:
    """load - dropped + scratch <= limit at the ticks that need a row (see the module)."""
    n = it.ticks
    lo = np.array([tr.gaps[k].a + 1 for k, _ in cands], np.int64)
    hi = np.array([t for _, t in cands], np.int64)
    points = np.array(sorted(scratch_at), np.int64)
    cuts = np.unique(np.concatenate(([0, n], lo, hi, points, points + 1)))
    cuts = cuts[cuts <= n]
    first = cuts[:-1]
    worst = np.maximum.reduceat(over_by, first)  # each stretch's highest load over the limit
    starts, ends = set(lo.tolist()), set(hi.tolist())
    keep = [False] * len(first)
    running = -np.inf
    for s in range(len(first)):  # drops only join: an earlier, higher row implies a later one
        if int(first[s]) in ends:
            running = -np.inf
        if worst[s] > 0 and worst[s] > running:
            keep[s] = True
        running = max(running, float(worst[s]))
    running = -np.inf
    for s in reversed(range(len(first))):  # drops only leave: and a later, higher one
        if s + 1 < len(first) and int(first[s + 1]) in starts:
            running = -np.inf
        if keep[s]:
            keep[s] = bool(worst[s] > running)
            running = max(running, float(worst[s]))
    scratch_rows = [
        s
        for s in range(len(first))
        if int(first[s]) in scratch_at
        and over_by[first[s]] + sum(tr.size[p] for p, _ in scratch_at[int(first[s])]) > 0
    ]
    rows = sorted(set(scratch_rows) | {s for s in range(len(first)) if keep[s]})
    # D[i], the bytes dropped at row i's ticks, as a running sum over the rows in tick order:
    # each candidate enters the row where its drop starts and the one where it ends, not
    # every row it spans.
    seg_lo = np.searchsorted(first, lo, side="left")
    seg_hi = np.searchsorted(first, hi, side="left")
    enter = np.searchsorted(rows, seg_lo, side="left")  # the first row it covers
    leave = np.searchsorted(rows, seg_hi, side="left")  # the first row past it
    change: list[list[tuple[int, float]]] = [[] for _ in rows]
    for j in range(len(cands)):
        if enter[j] < leave[j]:
            size = tr.gaps[cands[j][0]].size / _UNIT
            change[enter[j]].append((j, -size))
            if leave[j] < len(rows):
                change[leave[j]].append((j, size))
    scratchy = set(scratch_rows)
    previous = -1
    for r, s in enumerate(rows):
        need = float(worst[s]) / _UNIT
        d = prog.column(0.0, False, need if s not in scratchy else 0.0, highspy.kHighsInf)
        link = [(d, 1.0), *change[r]] + ([(previous, -1.0)] if previous >= 0 else [])
        prog.row(link, 0.0, 0.0)
        if s in scratchy:
            held = [(col, -tr.size[p] / _UNIT) for p, col in scratch_at[int(first[s])]]
            prog.row([(d, 1.0), *held], need, highspy.kHighsInf)
        previous = d


def solve(
    it: Iteration,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    time_limit_s: float = 5.0,
    *,
    full_up_to: int = FULL,
) -> Remat:
    """The least-recompute plan of the program for `limit` (see the module), and how it was
    found. Every op of every gap is a rebuild point when that makes at most `full_up_to`
    candidates; otherwise the restricted set. The bandwidths are not used: nothing is copied."""
    del out_gbps, in_gbps
    over_by = load(it) - limit if it.ticks else np.zeros(0, np.int64)
    if not (over_by > 0).any():
        return Remat(SwapPlan(), "optimal", 0, 0.0, True)
    tr = _Trace(it)
    cands, exhaustive = _candidates(tr, over_by > 0, full_up_to)
    cands = _prune(tr, cands)
    prog = _Program()
    tie = 0.5 / (len(cands) + 1)  # all together under 1 ns: fewer recomputations on ties
    for _ in cands:
        prog.column(tie, True)
    at: dict[int, list[int]] = {}  # rebuild op -> candidates
    by_gap: dict[int, list[int]] = {}
    for j, (k, t) in enumerate(cands):
        at.setdefault(t, []).append(j)
        by_gap.setdefault(k, []).append(j)
    col_of = {kt: j for j, kt in enumerate(cands)}
    for js in by_gap.values():
        if len(js) > 1:
            prog.row([(j, 1.0) for j in js], -highspy.kHighsInf, 1.0)
    scratch_at: dict[int, list[tuple[int, int]]] = {}  # rebuild op -> (block, z column)
    for t, js in sorted(at.items()):
        ys: dict[int, int] = {}
        for j in js:
            for w in tr.gaps[cands[j][0]].writers:
                if w not in ys:
                    ys[w] = prog.column(float(tr.duration[w]), False)
                prog.row([(ys[w], 1.0), (j, -1.0)], 0.0, highspy.kHighsInf)
        zs: dict[int, int] = {}
        for w, y in ys.items():
            for pid in sorted(tr.reads.get(w, ())):  # the inputs: rebuilt with it, or on the device
                g = tr.gap_at(pid, t)
                mine = col_of.get((g, t)) if g is not None else None
                if not tr.usable(pid, w, t):  # it must be rebuilt with it (`_prune` saw to it
                    # that it can be, for the candidate that made y)
                    terms = [(y, 1.0)] + ([(mine, -1.0)] if mine is not None else [])
                    prog.row(terms, -highspy.kHighsInf, 0.0)
                    continue
                dropped = [d for d in by_gap.get(g, []) if cands[d][1] > t] if g is not None else []
                if dropped:
                    prog.row([(y, 1.0)] + [(d, 1.0) for d in dropped], -highspy.kHighsInf, 1.0)
            for pid in sorted(tr.writes.get(w, ())):  # the other outputs: scratch unless rebuilt
                if not tr.size.get(pid, 0):
                    continue
                if pid not in zs:
                    zs[pid] = prog.column(0.0, False)
                g = tr.gap_at(pid, t)
                mine = col_of.get((g, t)) if g is not None else None
                terms = [(zs[pid], 1.0), (y, -1.0)] + ([(mine, 1.0)] if mine is not None else [])
                prog.row(terms, 0.0, highspy.kHighsInf)
        if zs:
            scratch_at[t] = list(zs.items())
    _memory_rows(it, tr, cands, over_by, scratch_at, prog)
    return _run(tr, cands, prog, exhaustive, time_limit_s)


def _run(
    tr: _Trace,
    cands: list[tuple[int, int]],
    prog: _Program,
    exhaustive: bool,
    time_limit_s: float,
) -> Remat:
    """Solve with HiGHS (`highs.solver`: silent, one thread)."""
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(prog.cost), len(prog.lower)
    matrix = csr_matrix(
        (prog.vals, (prog.rows, prog.cols)), shape=(lp.num_row_, lp.num_col_), dtype=np.float64
    )
    lp.col_cost_ = np.array(prog.cost)
    lp.col_lower_ = np.array(prog.col_lower)
    lp.col_upper_ = np.array(prog.col_upper)
    lp.row_lower_ = np.array(prog.lower)
    lp.row_upper_ = np.array(prog.upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = matrix.indptr
    lp.a_matrix_.index_ = matrix.indices
    lp.a_matrix_.value_ = matrix.data
    lp.integrality_ = [
        highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
        for i in prog.integer
    ]
    solver = highs.solver(
        mip_max_nodes=_NODE_LIMIT,
        time_limit=float(time_limit_s),
        mip_rel_gap=0.0,
        mip_abs_gap=0.5,  # with the ties' < 0.5: optimal to the ns
    )
    solver.passModel(lp)
    solver.run()
    info = solver.getInfo()
    model = solver.getModelStatus()
    stats = {
        "columns": float(lp.num_col_),
        "rows": float(lp.num_row_),
        "nonzeros": float(matrix.nnz),
        "candidates": float(len(cands)),
        "nodes": float(info.mip_node_count),
    }
    bound = float(info.mip_dual_bound)
    if info.primal_solution_status != _FEASIBLE:
        status: Status = "infeasible" if model == highspy.HighsModelStatus.kInfeasible else "none"
        return Remat(SwapPlan(), status, 0, bound, exhaustive, stats)
    x = np.asarray(solver.getSolution().col_value)
    chosen = [cands[j] for j in range(len(cands)) if x[j] > 0.5]
    plan = SwapPlan(
        recomputes=tuple(
            Recompute(block=tr.gaps[k].block, drop_after=Tick(tr.gaps[k].a), before=Tick(t))
            for k, t in sorted(chosen, key=lambda kt: (kt[1], tr.gaps[kt[0]].a, kt[0]))
        )
    )
    runs = {(w, t) for k, t in chosen for w in tr.gaps[k].writers}
    ns = sum(tr.duration[w] for w, _ in runs)
    status = "optimal" if model == highspy.HighsModelStatus.kOptimal else "limit"
    return Remat(plan, status, ns, bound, exhaustive, stats)


def checkmate(
    it: Iteration, limit: int, out_gbps: float, in_gbps: float, time_limit_s: float = 5.0
) -> SwapPlan:
    """The recomputation-only plan of least recompute time for `limit` that the program finds
    (see the module; `solve` says how it was found); empty when it found none."""
    return solve(it, limit, out_gbps, in_gbps, time_limit_s).plan
