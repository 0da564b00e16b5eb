"""Convolution workspaces: μ-cuDNN's micro-batching (WR, WD) and SuperNeurons' per-step budget.

A kernel is one convolution pass of one layer (forward, backward-data, backward-filter). Its
benchmark table holds, per micro-batch size b and algorithm a, the time and the workspace of
running b samples with a. μ-cuDNN (Oyama et al., §3) splits the mini-batch B into micro-batches
that run one after another, each with its own algorithm, so that a fast algorithm that needs
much workspace at B can still run within a workspace limit at a smaller b:

    B = 256 ───▶ [ (128, FFT_TILING) ][ (128, FFT_TILING) ]   time: the sum; workspace: the max
                  one workspace, reused by each micro-batch in turn

- `wr`: Workspace Reuse (§3.2): each kernel alone under its limit M, by dynamic programming.
- `desirable` and `wd`: Workspace Division (§3.3): one workspace for the whole network, split
  among kernels by a 0-1 program over each kernel's desirable (Pareto) configurations.
- `budgets` and `fastest_fitting`: SuperNeurons (Wang et al., §3.5): the workspace a step can
  have is the memory its plan leaves free there; each convolution gets the fastest
  configuration that fits it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import highspy
import numpy as np
from scipy.sparse import csr_matrix
from tidalcore.units import ALIGNMENT, Bytes, Tick

from tidalplan import highs
from tidalplan.learn import to_problem
from tidalplan.placed import Combined
from tidalplan.validate import validate

BatchPolicy = Literal["all", "powerOfTwo", "undivided"]
POLICIES: tuple[BatchPolicy, ...] = get_args(BatchPolicy)

_FEASIBLE = 2  # HiGHS' primal_solution_status of a feasible solution
_RETRIES = 4  # re-solves of WD when HiGHS' tolerance let the exact byte total pass its limit


class NoFit(ValueError):
    """No configuration meets the workspace limit: the message names the kernel(s) and bytes."""


@dataclass(frozen=True, slots=True)
class Micro:
    """A micro-configuration (§3.1): `batch` samples run with `algorithm`, as measured."""

    batch: int
    algorithm: str
    time_ns: int
    workspace: Bytes

    def __post_init__(self) -> None:
        for name in ("batch", "time_ns", "workspace"):
            value = getattr(self, name)
            if isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            try:
                object.__setattr__(self, name, operator.index(value))
            except TypeError:
                raise ValueError(f"{name} must be an integer, got {value!r}") from None
        if self.batch < 1:
            raise ValueError(f"batch must be positive, got {self.batch}")
        if self.time_ns < 0:
            raise ValueError(f"time_ns must not be negative, got {self.time_ns}")
        if self.workspace < 0:
            raise ValueError(f"workspace must not be negative, got {self.workspace}")


@dataclass(frozen=True, slots=True)
class Config:
    """A configuration (§3.1): micro-batches run one after another on one workspace, so its
    time is the sum of theirs and its workspace M(c) the largest of theirs. Kept sorted (the
    order of a kernel's micro-batches changes neither)."""

    micros: tuple[Micro, ...]

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.micros, key=lambda m: (-m.batch, m.algorithm)))
        object.__setattr__(self, "micros", ordered)

    @property
    def batch(self) -> int:
        return sum(m.batch for m in self.micros)

    @property
    def time_ns(self) -> int:
        return sum(m.time_ns for m in self.micros)

    @property
    def workspace(self) -> Bytes:
        return Bytes(max((m.workspace for m in self.micros), default=0))


Entry = Micro | tuple[int, str, int, int]  # (batch, algorithm, time_ns, workspace)


@dataclass(frozen=True, slots=True)
class Table:
    """Benchmark tables: kernel name -> its measured micro-configurations. Made by `Table.of`,
    which checks every entry and names the kernel and the entry of the first bad one."""

    kernels: Mapping[str, tuple[Micro, ...]]

    @classmethod
    def of(cls, measured: Mapping[str, Iterable[Entry]]) -> Table:
        kernels: dict[str, tuple[Micro, ...]] = {}
        for name, entries in measured.items():
            micros: list[Micro] = []
            seen: set[tuple[int, str]] = set()
            for k, entry in enumerate(entries):
                try:
                    if isinstance(entry, Micro):
                        micro = entry
                    else:
                        b, a, t, w = entry
                        micro = Micro(b, a, t, Bytes(w))
                except (TypeError, ValueError) as e:
                    raise ValueError(f"kernel {name!r}, entry {k} {entry!r}: {e}") from None
                if (micro.batch, micro.algorithm) in seen:
                    raise ValueError(
                        f"kernel {name!r}, entry {k}: batch {micro.batch} with algorithm"
                        f" {micro.algorithm!r} is measured twice"
                    )
                seen.add((micro.batch, micro.algorithm))
                micros.append(micro)
            if not micros:
                raise ValueError(f"kernel {name!r} has no measured entry")
            kernels[name] = tuple(micros)
        return cls(kernels)


def batch_sizes(policy: BatchPolicy, batch: int) -> tuple[int, ...]:
    """The micro-batch sizes a batch-size policy benchmarks (§3.4): `all` 1..B, `powerOfTwo`
    1, 2, 4, ... and B itself, `undivided` B alone."""
    if batch < 1:
        raise ValueError(f"the mini-batch must be positive, got {batch}")
    if policy == "all":
        return tuple(range(1, batch + 1))
    if policy == "powerOfTwo":
        powers = [1 << k for k in range(batch.bit_length()) if 1 << k < batch]
        return (*powers, batch)
    if policy == "undivided":
        return (batch,)
    raise ValueError(f"unknown batch-size policy {policy!r}; one of {POLICIES}")


def _order(c: Config) -> tuple[int, int, int, tuple[tuple[int, str], ...]]:
    """Less workspace first, then faster, then fewer samples, then by micro-batches."""
    return c.workspace, c.time_ns, -c.batch, tuple((m.batch, m.algorithm) for m in c.micros)


def pareto(configs: Iterable[Config]) -> tuple[Config, ...]:
    """D(C) of §3.3.1: the configurations no other one beats, at least as fast with at most as
    much workspace and better in one; one per (time, workspace), by increasing workspace.

    The paper's insertion (keep a candidate only when it needs less workspace than every faster
    one) as one sweep in order of (workspace, time): a configuration is kept when it is faster
    than every one kept before."""
    kept: list[Config] = []
    for c in sorted(configs, key=_order):
        if not kept or c.time_ns < kept[-1].time_ns:
            kept.append(c)
    return tuple(kept)


def _measured(entries: Iterable[Micro], batch: int, policy: BatchPolicy) -> dict[int, list[Micro]]:
    """The entries a policy benchmarks, by micro-batch size (each size's undominated ones)."""
    sizes = set(batch_sizes(policy, batch))
    by: dict[int, list[Micro]] = {}
    for m in entries:
        if m.batch in sizes:
            by.setdefault(m.batch, []).append(m)
    return {
        b: [c.micros[0] for c in pareto(Config((m,)) for m in ms)] for b, ms in sorted(by.items())
    }


def fastest(
    entries: Iterable[Micro], batch: int, limit: int, policy: BatchPolicy = "all"
) -> Config | None:
    """WR (§3.2) under workspace limit `limit` (M) for mini-batch `batch` (B), or None when no
    division of B into measured micro-batches fits M. T(0) = 0 and

        T(b) = min over measured b_μ <= b of T_μ(b_μ) + T(b - b_μ)

    where T_μ(b) is the fastest entry of micro-batch b with workspace <= M: the paper's
    T(B) = min{T_μ(B), min_b T(b) + T(B - b)} unrolled on the first micro-batch. Ties go to
    less workspace, then to the larger first micro-batch (the undivided B first)."""
    best: dict[int, Micro] = {}
    for b, ms in _measured(entries, batch, policy).items():
        fits = [m for m in ms if m.workspace <= limit]
        if fits:
            best[b] = min(fits, key=lambda m: (m.time_ns, m.workspace, m.algorithm))
    inf = (math.inf, math.inf)
    value: list[tuple[float, float]] = [(0.0, 0.0)] + [inf] * batch  # (time, workspace)
    first = [0] * (batch + 1)
    sizes = sorted(best, reverse=True)
    for b in range(1, batch + 1):
        for u in sizes:
            if u > b or value[b - u] == inf:
                continue
            m = best[u]
            rest_t, rest_w = value[b - u]
            v = (m.time_ns + rest_t, max(float(m.workspace), rest_w))
            if v < value[b]:
                value[b], first[b] = v, u
    if value[batch] == inf:
        return None
    micros: list[Micro] = []
    b = batch
    while b:
        micros.append(best[first[b]])
        b -= first[b]
    return Config(tuple(micros))


def wr(entries: Iterable[Micro], batch: int, limit: int, policy: BatchPolicy = "all") -> Config:
    """`fastest`, raising NoFit when nothing fits `limit`."""
    entries = tuple(entries)
    found = fastest(entries, batch, limit, policy)
    if found is None:
        sizes = set(batch_sizes(policy, batch))
        least = min((m.workspace for m in entries if m.batch in sizes), default=None)
        raise NoFit(
            f"no division of the mini-batch {batch} ({policy}) fits a workspace of {limit}"
            f" bytes; the least any measured entry needs is {least}"
        )
    return found


def desirable(
    entries: Iterable[Micro], batch: int, policy: BatchPolicy = "all"
) -> tuple[Config, ...]:
    """D(C(B)) of §3.3.1, exact: the Pareto set over (time, workspace) of every division of B
    into measured micro-batches, by increasing workspace (decreasing time).

    Because M of {c_μ} + c is max(M(c_μ), M(c)), the fastest configuration needing at most w
    is built from the fastest ones at most w of its parts: the front of C(b) is the step
    function w -> T_w(b), WR's T(b) under limit w, and pruning at every b (the paper's D) loses
    nothing. The DP runs at every threshold w of the sorted workspaces at once (one array row
    per b); the front is where T_w(B) drops as w grows, and each point's workspace is its w."""
    measured = _measured(entries, batch, policy)
    if not measured:
        return ()
    grid = np.array(sorted({m.workspace for ms in measured.values() for m in ms}), np.float64)
    sizes = np.array(sorted(measured, reverse=True), np.int64)  # larger first wins ties
    width = len(grid)
    t_mu = np.full((len(sizes), width), np.inf)
    pick = np.zeros((len(sizes), width), np.int64)  # index in measured[u] of T_μ(u) at w
    for i, u in enumerate(sizes):
        ms = measured[int(u)]
        fits = np.array([m.workspace for m in ms], np.float64)[:, None] <= grid[None, :]
        times = np.where(fits, np.array([m.time_ns for m in ms], np.float64)[:, None], np.inf)
        pick[i] = np.argmin(times, axis=0)
        t_mu[i] = times[pick[i], np.arange(width)]
    value = np.full((batch + 1, width), np.inf)
    value[0] = 0.0
    first = np.zeros((batch + 1, width), np.int64)  # index in `sizes` of the first micro-batch
    cols = np.arange(width)
    for b in range(1, batch + 1):
        usable = np.flatnonzero(sizes <= b)
        if not len(usable):
            continue
        cand = t_mu[usable] + value[b - sizes[usable]]
        arg = np.argmin(cand, axis=0)
        value[b] = cand[arg, cols]
        first[b] = usable[arg]
    front: list[Config] = []
    last = np.inf
    for w in range(width):
        if value[batch, w] >= last:
            continue
        last = value[batch, w]
        micros: list[Micro] = []
        b = batch
        while b:
            i = int(first[b, w])
            micros.append(measured[int(sizes[i])][int(pick[i, w])])
            b -= int(sizes[i])
        front.append(Config(tuple(micros)))
    return pareto(front)


@dataclass(frozen=True, slots=True)
class Division:
    """WD's answer (§3.3): one configuration per kernel, their total time and workspace, and
    whether HiGHS proved it optimal (`bound_ns`: its lower bound on the total time)."""

    configs: Mapping[str, Config]
    time_ns: int
    workspace: Bytes
    optimal: bool
    bound_ns: int


def choose(
    fronts: Mapping[str, Sequence[Config]], limit: int, time_limit_s: float = 10.0
) -> Division:
    """WD's 0-1 program (§3.3, equations 1-4) over each kernel's desirable configurations:

        min Σ_k Σ_c T_k(c) x_kc   s.t.  Σ_k Σ_c M_k(c) x_kc <= M,  Σ_c x_kc = 1,  x_kc in {0, 1}

    solved by HiGHS (`highs.solver`: one thread, deterministic). Raises NoFit when even the
    least workspace of every kernel sums past `limit` (M)."""
    names = list(fronts)
    empty = [k for k in names if not fronts[k]]
    if empty:
        raise NoFit(f"kernel {empty[0]!r} has no configuration to choose from")
    least = {k: min(c.workspace for c in fronts[k]) for k in names}
    floor = sum(least.values())
    if floor > limit:
        raise NoFit(
            f"the {len(names)} kernels need at least {floor} bytes of workspace together,"
            f" over the limit of {limit} bytes"
        )
    # A configuration over the room the others leave can never be chosen.
    cols = [(k, c) for k in names for c in fronts[k] if c.workspace <= limit - (floor - least[k])]
    row_of = {k: r for r, k in enumerate(names)}
    n = len(cols)
    scale = float(max(limit, 1))
    rows = np.array([row_of[k] for k, _ in cols] + [len(names)] * n, np.int64)
    vals = np.array([1.0] * n + [c.workspace / scale for _, c in cols], np.float64)
    idx = np.concatenate((np.arange(n), np.arange(n)))
    matrix = csr_matrix((vals, (rows, idx)), shape=(len(names) + 1, n))
    matrix.eliminate_zeros()
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, len(names) + 1
    lp.col_cost_ = np.array([float(c.time_ns) for _, c in cols])
    lp.col_lower_ = np.zeros(n)
    lp.col_upper_ = np.ones(n)
    lp.row_lower_ = np.concatenate((np.ones(len(names)), [-highspy.kHighsInf]))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = matrix.indptr
    lp.a_matrix_.index_ = matrix.indices
    lp.a_matrix_.value_ = matrix.data
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n
    room = float(limit)
    for _ in range(_RETRIES):
        lp.row_upper_ = np.concatenate((np.ones(len(names)), [room / scale]))
        solver = highs.solver(time_limit=float(time_limit_s), mip_rel_gap=0.0, mip_abs_gap=0.5)
        solver.passModel(lp)
        solver.run()
        info = solver.getInfo()
        if info.primal_solution_status != _FEASIBLE:
            raise NoFit(f"HiGHS found no choice within {time_limit_s} s under {limit} bytes")
        x = np.asarray(solver.getSolution().col_value)
        chosen: dict[str, Config] = {}
        weight: dict[str, float] = {}
        for j, (k, c) in enumerate(cols):
            if x[j] > weight.get(k, -1.0):
                chosen[k], weight[k] = c, float(x[j])
        total = sum(c.workspace for c in chosen.values())
        if total <= limit:
            time_ns = sum(c.time_ns for c in chosen.values())
            # Times are whole ns: the bound rounds up, past HiGHS' float noise.
            bound = min(time_ns, math.ceil(float(info.mip_dual_bound) - 1e-6))
            return Division(
                {k: chosen[k] for k in names},
                time_ns,
                Bytes(total),
                solver.getModelStatus() == highspy.HighsModelStatus.kOptimal,
                bound,
            )
        room -= total - limit  # within HiGHS' tolerance, past the limit in exact bytes
    raise NoFit(f"HiGHS' choices kept passing the limit of {limit} bytes")


def wd(
    table: Table,
    batch: int,
    limit: int,
    policy: BatchPolicy = "all",
    time_limit_s: float = 10.0,
) -> Division:
    """WD (§3.3) for every kernel of `table` at mini-batch `batch` under a total workspace
    `limit`: each kernel's desirable set (`desirable`), then the 0-1 program (`choose`)."""
    fronts = {k: desirable(entries, batch, policy) for k, entries in table.kernels.items()}
    return choose(fronts, limit, time_limit_s)


@dataclass(frozen=True, slots=True)
class Budget:
    """The workspace an op can have under a placed plan: `contiguous`, the largest free range
    of the arena at its tick, and `free`, the limit less the persistent bytes and the pieces
    live there (sizes as placed)."""

    tick: Tick
    op: str
    contiguous: Bytes
    free: Bytes


def budgets(placed: Combined, limit: int, alignment: int = ALIGNMENT) -> tuple[Budget, ...]:
    """SuperNeurons §3.5 under a plan: per op, the memory its step leaves for a workspace.

    Device memory under `limit`: the resident persistent bytes below, the arena of placed
    pieces (at their offsets, sizes rounded to `alignment` as `combine` placed them) above:

        limit ┬────────────┐
              │ ░░░░░░░░░░ │ ← free above the highest piece live at the tick
              │ piece      │
              │ ░░░░░░░░░░ │ ← a hole: a piece placed here is not live at the tick
              │ piece      │
        0     ├────────────┤ arena base = resident_persistent
              │ persistent │
              └────────────┘

    A workspace is one allocation, so what an op can really be given is the largest hole
    (`contiguous`); `free`, the sum of the holes, overstates it wherever the plan leaves its
    free bytes in pieces. Only pieces live at the op's tick take bytes: a placed piece holds
    its range over its own lifetime alone."""
    pieces = placed.pieces
    problem, index = to_problem(pieces, alignment)
    validate(problem, placed.placement)
    top = limit - int(placed.resident_persistent)
    if top < int(placed.placement.height):
        raise ValueError(
            f"the placed plan needs {int(placed.footprint)} bytes, over the limit of {limit}"
        )
    blocks = [pieces.blocks[i] for i in index]
    start = np.array([b.start for b in blocks], np.int64)
    end = np.array([b.end for b in blocks], np.int64)
    crosses = np.array([b.crosses for b in blocks], np.bool_)
    lo = np.array(placed.placement.offsets, np.int64)
    hi = lo + np.array([b.size for b in problem.buffers], np.int64)
    out: list[Budget] = []
    for op in pieces.ops:
        t = int(op.tick)
        live = ((start <= t) & (t < end)) | (crosses & (t < end - pieces.ticks))
        order = np.argsort(lo[live], kind="stable")
        a, z = lo[live][order], hi[live][order]
        holes = np.concatenate((a, [top])) - np.concatenate(([0], z))  # live ones never overlap
        out.append(
            Budget(
                op.tick,
                op.name,
                Bytes(int(max(holes.max(), 0))),
                Bytes(top - int((z - a).sum())),
            )
        )
    return tuple(out)


def fastest_fitting(
    entries: Iterable[Micro],
    budget: int,
    batch: int | None = None,
    policy: BatchPolicy = "all",
) -> Config | None:
    """The fastest WR configuration (§3.2) whose workspace fits `budget`, the bytes free at
    the op's step (SuperNeurons §3.5: each layer takes the fastest algorithm that fits what its
    step leaves). `batch`: the mini-batch, by default the largest micro-batch measured. None
    when nothing fits: the caller runs without this convolution's workspace choice."""
    entries = tuple(entries)
    if batch is None:
        batch = max((m.batch for m in entries), default=0)
        if not batch:
            return None
    return fastest(entries, batch, budget, policy)
