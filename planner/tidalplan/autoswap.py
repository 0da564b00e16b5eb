"""AutoSwap (SmartPool/AutoSwap, Section IV): pick blocks to swap until the memory load fits.

    load ▲        peak
         │      ┌──┐          candidate b: size >= threshold, live across the peak,
         │   ┌──┘  └──┐       with an access gap (out_after, in_before) around it
         │ ┌─┘ ░░░░░░ └─┐     ░: b's bytes off the device when swapped over its gap
         └─┴──┼──────┼──┴──▶ tick
          out_after  in_before

The memory load is the persistent bytes plus `learn.live_bytes` at each tick; time
is measured in ns by the ops' durations (allocs and frees take none). Candidates
(IV-A) are ranked by a priority score (IV-B), picked greedily while the load is
updated (IV-D), and scheduled (IV-E): out right after `out_after`, in issued as
late as the copy still fits in the compute before `in_before`. The Bayesian
optimization of the score weights (IV-C) is `autoswap_bo`; `combined` takes the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from tidalcore.units import Bytes, Tick

from tidalplan.learn import live_bytes
from tidalplan.model import Iteration, Swap, SwapPlan
from tidalplan.simulate import copy_ns

Score = Literal["doa", "aoa", "wdoa", "swdoa", "combined"]
SCORES: tuple[Score, ...] = ("doa", "aoa", "wdoa", "swdoa", "combined")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A block that may be off the device over its access gap around the peak."""

    block: int  # index into `Iteration.blocks`
    size: Bytes
    out_after: Tick  # the op tick of the access before the gap
    in_before: Tick  # the op tick of the access after it
    gap_ns: int  # durations of the ops strictly between the two


def load(it: Iteration) -> npt.NDArray[np.int64]:
    """Device bytes at each tick with no swaps: persistent bytes plus transient live bytes."""
    return live_bytes(it) + sum(size for _, size in it.persistent)


def durations(it: Iteration) -> npt.NDArray[np.int64]:
    """ns spent at each tick: the op's duration, 0 for allocs and frees."""
    d = np.zeros(it.ticks, np.int64)
    for op in it.ops:
        d[op.tick] = op.duration_ns
    return d


def candidates(
    it: Iteration, threshold_bytes: int, curve: npt.NDArray[np.int64] | None = None
) -> list[Candidate]:
    """IV-A: transient blocks of at least `threshold_bytes` with two consecutive accesses
    (within their lifetime) on either side of the peak tick and none at it (the peak: the
    earliest highest value of `curve`, by default the load)."""
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
    return out


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
    between the two accesses. The paper gives it in words only (no numbered equation); with
    the original load it is WDOA, with the load updated by earlier picks it is SWDOA (IV-B iv)."""
    lo, hi = c.out_after + 1, c.in_before
    return int((curve[lo:hi] * dur[lo:hi]).sum())


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
        self.block = np.array([c.block for c in cands], np.int64)
        self.lo = np.array([c.out_after + 1 for c in cands], np.int64)
        self.hi = np.array([c.in_before for c in cands], np.int64)
        self.doa = np.array([doa(c, out_gbps, in_gbps) for c in cands], np.float64)
        self.aoa = np.array([aoa(c, out_gbps, in_gbps) for c in cands], np.float64)
        area = _prefix_area(original, dur)
        self.wdoa = area[self.hi] - area[self.lo]

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
        area = _prefix_area(current, self.dur)
        swdoa = area[self.hi[idx]] - area[self.lo[idx]]
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


def swap_in_tick(
    it: Iteration, c: Candidate, in_gbps: float, dur: npt.NDArray[np.int64] | None = None
) -> Tick:
    """IV-E: the latest tick from which the ops before `in_before` take at least the swap-in's
    copy time, but never before `out_after + 1`. `dur` is `durations(it)`, if at hand."""
    if dur is None:
        dur = durations(it)
    need = copy_ns(c.size, in_gbps)
    # have[k]: the ops' time over ticks in_before-1-k .. in_before-1
    have = np.cumsum(dur[c.out_after + 1 : c.in_before][::-1])
    k = int(np.searchsorted(have, need, side="left"))
    return Tick(c.in_before - 1 - k) if k < len(have) else Tick(c.out_after + 1)


def autoswap(
    it: Iteration,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    score: Score = "swdoa",
    weights: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 1.0),
    threshold_bytes: int = 0,
) -> SwapPlan:
    """IV-D and IV-E: swap the best-scoring remaining candidate (ties: lowest block index), take
    its bytes off the load over its gap, rescore, and stop once the load's peak is at most
    `limit`. When no candidate is left the load's peak is at `load_min` or has moved: the
    candidates across the new peak join, among them other gaps of blocks already picked,
    which are then swapped more than once. The plan's swaps are in pick order; it holds
    every gap it could find when the limit is never met."""
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; one of {SCORES}")
    original = load(it)
    current = original.copy()
    dur = durations(it)
    picked: list[Candidate] = []
    taken: set[tuple[int, int]] = set()  # (block, out_after) of the picked gaps
    cands = candidates(it, threshold_bytes)
    while int(current.max(initial=0)) > limit:
        if not cands:  # a new round: the gaps across the peak the picks have left
            cands = [
                c
                for c in candidates(it, threshold_bytes, current)
                if (c.block, c.out_after) not in taken
            ]
            if not cands:
                break
        table = _Table(cands, original, dur, out_gbps, in_gbps)
        left = np.arange(len(cands))
        while len(left) and int(current.max(initial=0)) > limit:
            s = table.scores(left, score, current, weights)
            k = int(left[np.lexsort((table.block[left], -s))[0]])
            c = cands[k]
            current[c.out_after + 1 : c.in_before] -= c.size
            picked.append(c)
            taken.add((c.block, c.out_after))
            left = left[left != k]
        cands = []
    return SwapPlan(
        tuple(
            Swap(c.block, c.out_after, c.in_before, swap_in_tick(it, c, in_gbps, dur))
            for c in picked
        )
    )


def op_bound(it: Iteration) -> int:
    """SuperNeurons' op-wise lower bound max(l_i): the most bytes any single op touches (the
    distinct blocks it reads or writes, persistent ones included). No swap plan can keep an
    op's blocks on the device with less."""
    sizes = {b.id: b.size for b in it.blocks}
    sizes.update(it.persistent)
    touched: dict[int, set[int]] = {}
    for a in it.accesses:
        touched.setdefault(a.tick, set()).add(a.block)
    return max((sum(sizes.get(b, 0) for b in bs) for bs in touched.values()), default=0)


def load_min(it: Iteration, threshold_bytes: int = 0) -> int:
    """The lowest peak load swapping can reach (VI-B's load_min): the peak with every candidate
    off the device over its whole gap, copies taking no time."""
    curve = load(it)
    for c in candidates(it, threshold_bytes):
        curve[c.out_after + 1 : c.in_before] -= c.size
    return int(curve.max(initial=0))
