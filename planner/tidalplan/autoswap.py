"""AutoSwap (SmartPool/AutoSwap, Section IV): pick blocks to swap until the memory load fits.

    load ▲        peak
         │      ┌──┐          candidate b: size >= threshold, live across the peak,
         │   ┌──┘  └──┐       with an access gap (out_after, in_before) around it
         │ ┌─┘ ░░░░░░ └─┐     ░: b's bytes off the device when swapped over its gap
         └─┴──┼──────┼──┴──▶ tick
          out_after  in_before

    weight W  ░░░░┤W├──────────┤W├░░░░░   a persistent block: every gap between two of its
              0                        T  accesses, and the one across the boundary (out
                                          after its last access, back before its first)

The memory load is the persistent bytes plus `learn.live_bytes` at each tick; time
is measured in ns by the ops' durations (allocs and frees take none). Candidates
(IV-A, and VI-B3 for persistent blocks) are ranked by a priority score (IV-B),
picked greedily while the load is updated (IV-D), and scheduled (IV-E): out right
after `out_after`, in issued as late as the serial swap-in stream still has every
copy done by the op that needs its block. The Bayesian optimization of the score
weights (IV-C) is `autoswap_bo`; `combined` takes the weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt
from tidalcore.units import Bytes, Tick

from tidalplan.model import Iteration, Swap, SwapPlan

# Re-exported: AutoSwap's load and durations, and the op-wise bound, are named here too.
from tidalplan.profile import durations as durations
from tidalplan.profile import load as load
from tidalplan.profile import op_bound as op_bound
from tidalplan.simulate import copy_ns, simulate

Score = Literal["doa", "aoa", "wdoa", "swdoa", "combined"]
SCORES: tuple[Score, ...] = ("doa", "aoa", "wdoa", "swdoa", "combined")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A block that may be off the device over one of its access gaps.

    A persistent block's gap may cross the iteration boundary (`in_before` <= `out_after`):
    it is away from `out_after` to the end of the iteration and from its start to `in_before`.
    """

    block: int  # index into `Iteration.blocks`, or `Iteration.persistent` when `persistent`
    size: Bytes
    out_after: Tick  # the op tick of the access before the gap
    in_before: Tick  # the op tick of the access after it
    gap_ns: int  # durations of the ops strictly between the two (wrapping across the boundary)
    persistent: bool = False

    @property
    def crosses(self) -> bool:
        """Whether the gap wraps across the iteration boundary."""
        return self.in_before <= self.out_after


def _over_gap(v: npt.NDArray[np.int64], out_after: int, in_before: int) -> int:
    """The sum of `v` over the ticks strictly between the two accesses (wrapping when
    `in_before` <= `out_after`)."""
    if in_before > out_after:
        return int(v[out_after + 1 : in_before].sum())
    return int(v[out_after + 1 :].sum() + v[:in_before].sum())


def _take(curve: npt.NDArray[np.int64], c: Candidate) -> None:
    """Take c's bytes off `curve` over its gap, in place."""
    if c.crosses:
        curve[c.out_after + 1 :] -= c.size
        curve[: c.in_before] -= c.size
    else:
        curve[c.out_after + 1 : c.in_before] -= c.size


def _persistent(
    it: Iteration, threshold_bytes: int, dur: npt.NDArray[np.int64], peak: int
) -> list[Candidate]:
    """VI-B3 with IV-A's rule: the gap of each persistent block of at least `threshold_bytes`
    between its two consecutive accesses on either side of tick `peak`, the gap across the
    boundary (its last access, then its first in the next iteration) included."""
    ticks: dict[int, set[int]] = {}
    for a in it.accesses:
        ticks.setdefault(a.block, set()).add(a.tick)
    out: list[Candidate] = []
    for j, (trace_id, size) in enumerate(it.persistent):
        mine = sorted(ticks.get(trace_id, ()))
        if size < threshold_bytes or not mine:
            continue
        for lo, hi in [*itertools.pairwise(mine), (mine[-1], mine[0])]:
            spans = lo < peak < hi if hi > lo else (peak > lo or peak < hi)
            if spans:
                gap = _over_gap(dur, lo, hi)
                out.append(Candidate(j, size, Tick(lo), Tick(hi), gap, persistent=True))
    return out


def candidates(
    it: Iteration, threshold_bytes: int, curve: npt.NDArray[np.int64] | None = None
) -> list[Candidate]:
    """IV-A: transient blocks of at least `threshold_bytes` with two consecutive accesses
    (within their lifetime) on either side of the peak tick and none at it (the peak: the
    earliest highest value of `curve`, by default the load); then persistent blocks' gaps.

    Persistent blocks live across every peak; VI-B3: "there are a number of variables whose
    lifetime and two consecutive accesses are cross one or more iterations, such as weights
    ... They are more favorable for swapping which can be swapped out at one iteration after
    the last access and swapped back at the next iteration before the first access ... Our
    PS and BO successfully capture them". So their gaps across the peak are candidates as
    the transient blocks' are, the one across the iteration boundary included (new rounds
    around a moved peak reach their other gaps)."""
    if not it.ticks:
        return []
    peak = int(np.argmax(load(it) if curve is None else curve))
    dur = durations(it)
    ticks: dict[int, set[int]] = {}
    for a in it.accesses:
        ticks.setdefault(a.block, set()).add(a.tick)
    out: list[Candidate] = []
    for i, b in enumerate(it.blocks):
        if b.size < threshold_bytes or not b.start < peak < b.end:
            continue
        mine = sorted(t for t in ticks.get(b.id, ()) if b.start < t < b.end)
        before = [t for t in mine if t < peak]
        after = [t for t in mine if t > peak]
        if before and after and peak not in mine:  # it is needed at the peak itself
            lo, hi = before[-1], after[0]
            gap = int(dur[lo + 1 : hi].sum())
            out.append(Candidate(i, b.size, Tick(lo), Tick(hi), gap))
    return out + _persistent(it, threshold_bytes, dur, peak)


def doa(c: Candidate, out_gbps: float, in_gbps: float) -> int:
    """Duration of Absence (IV-B i): the time between the two accesses less the swap-out and
    swap-in copy times; negative when the copies take longer than the gap."""
    return c.gap_ns - copy_ns(c.size, out_gbps) - copy_ns(c.size, in_gbps)


def aoa(c: Candidate, out_gbps: float, in_gbps: float) -> float:
    """Area of Absence (IV-B ii): DOA × size; for a negative DOA, DOA / size (the paper's
    "product of the inverse of variable size and DOA"), so smaller blocks rank higher there."""
    d = doa(c, out_gbps, in_gbps)
    return float(d * c.size) if d >= 0 else d / c.size


def wdoa(c: Candidate, curve: npt.NDArray[np.int64], dur: npt.NDArray[np.int64]) -> int:
    """Weighted Duration of Absence (IV-B iii): the area (bytes × ns) under the load `curve`
    between the two accesses (wrapping across the boundary for a gap that crosses it). The
    paper gives it in words only (no numbered equation); with the original load it is WDOA,
    with the load updated by earlier picks it is SWDOA (IV-B iv)."""
    return _over_gap(curve * dur, c.out_after, c.in_before)


def _standard(v: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """(v - mean) / standard deviation; all 0.0 when v is constant."""
    sd = float(v.std())
    return np.zeros_like(v) if sd == 0.0 else (v - v.mean()) / sd


def _prefix_area(
    curve: npt.NDArray[np.int64], dur: npt.NDArray[np.int64]
) -> npt.NDArray[np.float64]:
    """area[t] = sum of curve × dur over ticks before t (float: the products overflow int64)."""
    return np.concatenate(([0.0], np.cumsum(curve.astype(np.float64) * dur)))


class _Table:
    """The candidates' fixed scores as arrays, so that each pick rescoring is vectorized."""

    def __init__(
        self,
        cands: Sequence[Candidate],
        original: npt.NDArray[np.int64],
        dur: npt.NDArray[np.int64],
        out_gbps: float,
        in_gbps: float,
    ) -> None:
        self.dur = dur
        self.lo = np.array([c.out_after + 1 for c in cands], np.int64)
        self.hi = np.array([c.in_before for c in cands], np.int64)
        self.wraps = self.hi < self.lo  # across the boundary: [lo, end) and [0, hi)
        self.doa = np.array([doa(c, out_gbps, in_gbps) for c in cands], np.float64)
        self.aoa = np.array([aoa(c, out_gbps, in_gbps) for c in cands], np.float64)
        self.wdoa = self._area(_prefix_area(original, dur), np.arange(len(cands)))

    def _area(
        self, area: npt.NDArray[np.float64], idx: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        """The area under the curve over each gap of `idx`, from its prefix sums `area`."""
        whole = np.where(self.wraps[idx], area[-1], 0.0)
        got: npt.NDArray[np.float64] = area[self.hi[idx]] - area[self.lo[idx]] + whole
        return got

    def scores(
        self,
        idx: npt.NDArray[np.int64],
        score: Score,
        current: npt.NDArray[np.int64],
        weights: tuple[float, float, float, float],
    ) -> npt.NDArray[np.float64]:
        """The scores of candidates `idx` with the load now at `current`."""
        if score == "doa":
            return self.doa[idx]
        if score == "aoa":
            return self.aoa[idx]
        if score == "wdoa":
            return self.wdoa[idx]
        swdoa = self._area(_prefix_area(current, self.dur), idx)
        if score == "swdoa":
            return swdoa
        a, b, c, d = weights
        return (
            a * _standard(self.aoa[idx])
            + b * _standard(self.doa[idx])
            + c * _standard(self.wdoa[idx])
            + d * _standard(swdoa)
        )


def scores(
    cands: Sequence[Candidate],
    score: Score,
    original: npt.NDArray[np.int64],
    current: npt.NDArray[np.int64],
    dur: npt.NDArray[np.int64],
    out_gbps: float,
    in_gbps: float,
    weights: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 1.0),
) -> list[float]:
    """Each candidate's priority score; higher is swapped first. `combined` is Eq. (3),
    a·AOA + b·DOA + c·WDOA + d·SWDOA over the standardized scores of `cands`."""
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; one of {SCORES}")
    table = _Table(cands, original, dur, out_gbps, in_gbps)
    got: list[float] = table.scores(np.arange(len(cands)), score, current, weights).tolist()
    return got


def _starts(dur: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """start[t]: when tick t begins on the trace's timeline (no stalls); start[ticks]: the end."""
    return np.concatenate(([0], np.cumsum(dur))).astype(np.int64)


def _latest(start: npt.NDArray[np.int64], first: int, last: int, begin: int) -> Tick:
    """The latest tick in [first, last] that begins at or before `begin`; `first` if none does."""
    k = int(np.searchsorted(start[first : last + 1], begin, side="right")) - 1
    return Tick(first + max(k, 0))


def _first(c: Candidate) -> int:
    """The earliest tick c's swap-in may be issued at: after its swap-out's op, or the
    iteration's start for a gap across the boundary (the tail of the previous iteration,
    where the copy would begin when the ops before `in_before` cannot hide it, is not a tick
    of this one)."""
    return 0 if c.crosses else c.out_after + 1


def swap_in_tick(
    it: Iteration, c: Candidate, in_gbps: float, dur: npt.NDArray[np.int64] | None = None
) -> Tick:
    """IV-E for one swap alone: the latest tick from which the ops before `in_before` take at
    least the swap-in's copy time, but never before `_first(c)`. `dur` is `durations(it)`,
    if at hand."""
    start = _starts(durations(it) if dur is None else dur)
    begin = int(start[c.in_before]) - copy_ns(c.size, in_gbps)
    return _latest(start, _first(c), c.in_before, begin)


def swap_in_ticks(
    it: Iteration,
    picked: Sequence[Candidate],
    in_gbps: float,
    dur: npt.NDArray[np.int64] | None = None,
) -> list[Tick]:
    """IV-E: "The swap-in events are scheduled according to the next access time of each
    variable. A variable starts swap-in in advance to make sure its second access is not
    delayed by the communication. The schedule is designed in the way such that a variable
    starts swap-out (-in) only after the previous swap-out (-in) event completes."

    So the swap-ins are laid out on the one serial swap-in stream backwards from the last
    access: each ends by the op that needs its block and by the start of the swap-in after
    it in the stream, and is issued at the latest tick that begins no later than that
    (`_latest`; `_first` when even the earliest allowed tick is too late). Each copy's time
    is `copy_ns` at `in_gbps`, each tick's the trace's (`durations`). The ticks are
    parallel to `picked`; among swap-ins needed by the same op, the later pick goes last.
    A swap-in held back to `_first` keeps its place in the stream: those needed later are
    issued no earlier than it."""
    start = _starts(durations(it) if dur is None else dur)
    got = [Tick(0)] * len(picked)
    order = sorted(range(len(picked)), key=lambda i: (picked[i].in_before, i))
    bound = int(start[-1])  # the swap-in after this one starts no earlier than this
    for i in reversed(order):
        c = picked[i]
        first = _first(c)
        begin = min(int(start[c.in_before]), bound) - copy_ns(c.size, in_gbps)
        got[i] = _latest(start, first, c.in_before, begin)
        bound = max(begin, int(start[first]))
    for prev, i in itertools.pairwise(order):  # the stream runs in order of the next access
        got[i] = max(got[i], got[prev])
    return got


def autoswap(
    it: Iteration,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    score: Score = "swdoa",
    weights: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 1.0),
    threshold_bytes: int = 0,
) -> SwapPlan:
    """IV-D: "These variables are then sorted in descending order and inserted into a
    swapping list one by one according to the sorted order, while the memory load is updated
    (reduced) at the same time. When the peak memory load is no larger than the user-defined
    memory load limit, the selection stops."

    The best-scoring remaining candidate is swapped (ties: the earlier candidate, transient
    blocks in allocation order and then persistent ones), its bytes taken off the load over
    its gap, the rest rescored, until the load's peak is at most `limit`. When no candidate
    is left the load's peak is at `load_min` or has moved: the candidates across the new peak
    join, among them other gaps of blocks already picked, which are then swapped more than
    once (VI-B1). Swap-outs follow their op, swap-ins are timed by `swap_in_ticks` (IV-E).
    The plan's swaps are in pick order; it holds every gap it could find when the limit is
    never met."""
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; one of {SCORES}")
    original = load(it)
    current = original.copy()
    dur = durations(it)
    picked: list[Candidate] = []
    taken: set[tuple[bool, int, int]] = set()  # (persistent, block, out_after) of the picks
    cands = candidates(it, threshold_bytes)
    while int(current.max(initial=0)) > limit:
        if not cands:  # a new round: the gaps across the peak the picks have left
            cands = [
                c
                for c in candidates(it, threshold_bytes, current)
                if (c.persistent, c.block, c.out_after) not in taken
            ]
            if not cands:
                break
        table = _Table(cands, original, dur, out_gbps, in_gbps)
        left = np.arange(len(cands))
        while len(left) and int(current.max(initial=0)) > limit:
            s = table.scores(left, score, current, weights)
            k = int(left[np.lexsort((left, -s))[0]])
            c = cands[k]
            _take(current, c)
            picked.append(c)
            taken.add((c.persistent, c.block, c.out_after))
            left = left[left != k]
        cands = []
    at = swap_in_ticks(it, picked, in_gbps, dur)
    timed = SwapPlan(
        tuple(
            Swap(c.block, c.out_after, c.in_before, t, persistent=c.persistent)
            for c, t in zip(picked, at, strict=True)
        )
    )
    # IV-E lays the swap-ins out back to back before their accesses; where that issues one
    # so early that it waits for room ahead of a swap-in needed sooner, the same swaps with
    # each swap-in issued at the op before its access run instead: of the two, the faster in
    # simulation (IV-E's on a tie, and when neither fits).
    late = SwapPlan(tuple(replace(sw, in_at=None) for sw in timed.swaps))
    first = simulate(it, timed, limit, out_gbps, in_gbps)
    if first.feasible or not timed.swaps:
        other = simulate(it, late, limit, out_gbps, in_gbps)
        return late if other.feasible and other.iteration_ns < first.iteration_ns else timed
    return late if simulate(it, late, limit, out_gbps, in_gbps).feasible else timed


def load_min(it: Iteration, threshold_bytes: int = 0) -> int:
    """The lowest peak load swapping can reach (VI-B1's load_min, "achieved by swapping out
    and in all candidate variables synchronously"): the peak with every candidate, persistent
    gaps included, off the device over its whole gap, copies taking no time."""
    curve = load(it)
    for c in candidates(it, threshold_bytes):
        _take(curve, c)
    return int(curve.max(initial=0))
