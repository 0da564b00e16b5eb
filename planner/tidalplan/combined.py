"""The combined plan: a swap schedule first, then a placement of what it leaves on the device.

A swapped block is on the device in pieces: from its alloc until its swap-out's
copy finishes, and again from the start of its swap-in until its next swap-out
or its free. Each piece is a block of its own for Planner I, its lifetime in
ticks read off the simulated timeline:

    tick      a(alloc)   out_after  release            in_at/start of in    end(free)
    block     ████████████████████████┐                ┌████████████████████┐
    pieces    [a ..................... release)         [in tick ............ end)

`release` is the first tick that saw the copy finished (a malloc there may
reuse the bytes), and the in-piece starts at the last tick that happened
before the copy started: both read off `simulate`'s `swap_ticks`. A persistent
block that is swapped becomes pieces too; one that is not keeps its own bytes
outside the placement.

The footprint of the combination is those persistent bytes plus the placement's
height: what the device must really hold, fragmentation included. It can exceed
the limit the schedule was made for; `fit` makes the schedule again for lower
limits until the footprint fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidalcore.units import ALIGNMENT, Bytes, Tick

from tidalplan.learn import to_problem
from tidalplan.model import Iteration, IterBlock, Placement, SwapPlan
from tidalplan.placement import solve
from tidalplan.policies import plan as make_plan
from tidalplan.simulate import Result, simulate
from tidalplan.validate import validate_swaps


@dataclass(frozen=True, slots=True)
class Combined:
    pieces: Iteration  # the iteration with swapped blocks split into their device pieces
    placement: Placement  # of `pieces.blocks`
    resident_persistent: Bytes  # persistent bytes never swapped
    footprint: Bytes  # resident_persistent + placement.height


def pieces(it: Iteration, plan: SwapPlan, result: Result) -> Iteration:
    """`it` with every swapped block replaced by its device pieces (ids from max id + 1)."""
    if not result.feasible:
        raise ValueError("the swap plan is infeasible under its limit: nothing to place")
    if len(result.swap_ticks) != len(plan.swaps):
        raise ValueError("the result is not the simulation of this plan on this iteration")
    away: dict[tuple[bool, int], list[tuple[int, int]]] = {}  # (release tick, back tick)
    for s, (gone, back) in zip(plan.swaps, result.swap_ticks, strict=True):
        # Tick `gone` is the first to see the bytes free; the swap-in started after tick
        # back - 1 had happened, so the piece is live from there.
        away.setdefault((s.persistent, s.block), []).append((gone, max(back - 1, 0)))
    next_id = max([b.id for b in it.blocks] + [p for p, _ in it.persistent] + [0]) + 1
    blocks: list[IterBlock] = []
    for i, b in enumerate(it.blocks):
        gaps = sorted(away.get((False, i), ()))
        lo = int(b.start)
        for release, back in gaps:
            blocks.append(IterBlock(next_id, b.size, Tick(lo), Tick(max(release, lo + 1))))
            next_id += 1
            lo = back
        blocks.append(
            b if not gaps else IterBlock(next_id, b.size, Tick(lo), b.end, crosses=b.crosses)
        )
        next_id += 1 if gaps else 0
    resident: list[tuple[int, Bytes]] = []
    for j, (pid, size) in enumerate(it.persistent):
        gaps = sorted(away.get((True, j), ()))
        if not gaps:
            resident.append((pid, size))
            continue
        # On the device over the complement of its away intervals within [0, ticks).
        cuts: list[tuple[int, int]] = []  # away ranges [release, back) inside the iteration
        for release, back in gaps:
            if back < release:  # across the boundary: away over [release, T) and [0, back)
                cuts += [(release, it.ticks), (0, back)]
            else:
                cuts.append((release, back))
        pos = 0
        for a, c in sorted(cuts):
            if a > pos:
                blocks.append(IterBlock(next_id, size, Tick(pos), Tick(a)))
                next_id += 1
            pos = max(pos, c)
        if pos < it.ticks:
            blocks.append(IterBlock(next_id, size, Tick(pos), Tick(it.ticks)))
            next_id += 1
    blocks.sort(key=lambda b: (b.start, b.id))
    return Iteration(
        ticks=it.ticks,
        blocks=tuple(blocks),
        ops=it.ops,
        accesses=(),
        persistent=tuple(resident),
        index=it.index,
    )


@dataclass(frozen=True, slots=True)
class Fitted:
    plan: SwapPlan
    result: Result  # the plan simulated under `planned_for`
    combined: Combined  # its footprint is at most the limit asked for
    planned_for: Bytes  # the limit the schedule was made for: the limit less what placing cost
    rounds: int  # schedules made


def fit(
    it: Iteration,
    policy: str,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
    rounds: int = 8,
    alignment: int = ALIGNMENT,
    time_limit_s: float = 2.0,
    known: tuple[int, int] | None = None,
) -> Fitted | None:
    """The policy's swap plan whose combined footprint (placement included) fits `limit`.

    A schedule keeps the live bytes under its limit; the placement of what it leaves adds
    fragmentation, so the footprint can exceed that limit, and by an amount that moves
    unevenly with the limit (the placement is a time-limited search). The schedule is made
    for `limit`, then, while its footprint is over, for a limit lower by the excess and at
    least `step` below every limit tried (0.5% of `limit`; doubled each time the footprint
    did not shrink); an infeasible schedule halves the distance to the lowest limit tried.
    At most `rounds` schedules; None when none fits. `known`: (limit, footprint) of a
    schedule already placed, to start from. Each plan passes `validate_swaps` under its own
    limit."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    step = max(limit // 200, alignment)
    lowest, best = limit, None  # the lowest limit tried that did not fit; the least footprint

    def lower(target: int, footprint: int) -> int:
        nonlocal step, lowest, best
        if best is not None and footprint >= best:
            step *= 2  # no better than before: the excess is no guide here
        best = footprint if best is None else min(best, footprint)
        lowest = min(lowest, target)
        return min(target - (footprint - limit), lowest - step)

    target = limit if known is None else lower(*known)
    for k in range(1, rounds + 1):
        if target <= 0:
            return None
        plan = make_plan(it, policy, target, out_gbps, in_gbps)
        result = simulate(it, plan, target, out_gbps, in_gbps, compute_scale)
        if not result.feasible:
            if target >= lowest - alignment:
                return None
            target = (target + lowest) // 2  # too low: back towards the lowest that ran
            continue
        validate_swaps(it, plan, result, target, in_gbps)
        combined = combine(it, plan, result, alignment, time_limit_s)
        if combined.footprint <= limit:
            return Fitted(plan, result, combined, Bytes(target), k)
        target = lower(target, int(combined.footprint))
    return None


def combine(
    it: Iteration,
    plan: SwapPlan,
    result: Result,
    alignment: int = ALIGNMENT,
    time_limit_s: float = 2.0,
) -> Combined:
    """Place the pieces the swap plan leaves (Planner I) and report the footprint."""
    split = pieces(it, plan, result)
    problem, _ = to_problem(split, alignment)
    placement = solve(problem, time_limit_s=time_limit_s)
    resident = Bytes(sum(size for _, size in split.persistent))
    return Combined(split, placement, resident, Bytes(resident + placement.height))
