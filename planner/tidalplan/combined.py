"""The plan: a schedule (swaps and recomputations) and the placement of what it leaves.

A swapped block is on the device in pieces: from its alloc until its swap-out's
copy finishes, and again from the start of its swap-in until its next swap-out
or its free. Each piece is a block of its own for Planner I, its lifetime in
ticks read off the simulated timeline:

    tick      a(alloc)   out_after  release            in_at/start of in    end(free)
    block     ████████████████████████┐                ┌████████████████████┐
    pieces    [a ..................... release)         [in tick ............ end)

`release` is the first tick that saw the copy finished (a malloc there may
reuse the bytes), and the in-piece starts at the last tick that happened
before the copy started: both read off `simulate`'s `swap_ticks`. A dropped
(recomputed) block is gone from the tick after the op it is dropped after and
back at the op it is rebuilt for; each rebuild adds a piece for its scratch
at that op. A persistent block that is swapped becomes pieces too; one that is
not keeps its own bytes outside the placement.

The footprint of the plan is those persistent bytes plus the placement's
height: what the device must really hold, fragmentation included. It can exceed
the limit the schedule was made for; `fit` makes the schedule again for lower
limits until the footprint fits. A `Plan` is feasible (`fits`) only then: its
schedule ran under the simulator, passed `validate_swaps`, and its placement,
checked by `validate`, fits the limit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tidalcore.units import ALIGNMENT, Bytes, Tick

from tidalplan.learn import to_problem
from tidalplan.model import Iteration, IterBlock, Placement, SwapPlan
from tidalplan.placement import solve
from tidalplan.policies import plan as make_plan
from tidalplan.simulate import Result, rebuilds, simulate
from tidalplan.validate import validate, validate_swaps

BLOCK, PERSISTENT, SCRATCH = "block", "persistent", "scratch"


@dataclass(frozen=True, slots=True)
class Combined:
    pieces: Iteration  # the iteration with swapped blocks split into their device pieces
    placement: Placement  # of `pieces.blocks`
    resident_persistent: Bytes  # persistent bytes never swapped
    footprint: Bytes  # resident_persistent + placement.height
    # Piece id -> what it holds: (BLOCK, index in `Iteration.blocks`), (PERSISTENT, index in
    # `Iteration.persistent`) or (SCRATCH, the op tick of its rebuild).
    origin: dict[int, tuple[str, int]] = field(default_factory=dict, compare=False)


def pieces(it: Iteration, plan: SwapPlan, result: Result) -> Iteration:
    """`it` with every swapped or dropped block replaced by its device pieces (ids from max
    id + 1), and a piece for each rebuild's scratch."""
    return _split(it, plan, result)[0]


def _split(
    it: Iteration, plan: SwapPlan, result: Result
) -> tuple[Iteration, dict[int, tuple[str, int]]]:
    if not result.feasible:
        raise ValueError("the plan is infeasible under its limit: nothing to place")
    if len(result.swap_ticks) != len(plan.swaps):
        raise ValueError("the result is not the simulation of this plan on this iteration")
    away: dict[tuple[bool, int], list[tuple[int, int]]] = {}  # (release tick, back tick)
    for s, (gone, back) in zip(plan.swaps, result.swap_ticks, strict=True):
        # Tick `gone` is the first to see the bytes free; the swap-in started after tick
        # back - 1 had happened, so the piece is live from there.
        away.setdefault((s.persistent, s.block), []).append((gone, max(back - 1, 0)))
    for r in plan.recomputes:  # rebuilt at op `before`, after every earlier tick
        away.setdefault((False, r.block), []).append((r.drop_after + 1, r.before))
    next_id = max([b.id for b in it.blocks] + [p for p, _ in it.persistent] + [0]) + 1
    blocks: list[IterBlock] = []
    origin: dict[int, tuple[str, int]] = {}
    for i, b in enumerate(it.blocks):
        gaps = sorted(away.get((False, i), ()))
        lo = int(b.start)
        for release, back in gaps:
            blocks.append(IterBlock(next_id, b.size, Tick(lo), Tick(max(release, lo + 1))))
            origin[next_id] = (BLOCK, i)
            next_id += 1
            lo = back
        blocks.append(
            b if not gaps else IterBlock(next_id, b.size, Tick(lo), b.end, crosses=b.crosses)
        )
        origin[blocks[-1].id] = (BLOCK, i)
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
                origin[next_id] = (PERSISTENT, j)
                next_id += 1
            pos = max(pos, c)
        if pos < it.ticks:
            blocks.append(IterBlock(next_id, size, Tick(pos), Tick(it.ticks)))
            origin[next_id] = (PERSISTENT, j)
            next_id += 1
    durations: dict[int, int] = {int(op.tick): op.duration_ns for op in it.ops}
    for before, rebuild in sorted(rebuilds(it, plan, durations).items()):
        if rebuild.scratch:  # held while the rebuild runs, before the op at `before`
            blocks.append(
                IterBlock(next_id, Bytes(rebuild.scratch), Tick(before), Tick(before + 1))
            )
            origin[next_id] = (SCRATCH, before)
            next_id += 1
    blocks.sort(key=lambda b: (b.start, b.id))
    split = Iteration(
        ticks=it.ticks,
        blocks=tuple(blocks),
        ops=it.ops,
        accesses=(),
        persistent=tuple(resident),
        index=it.index,
    )
    return split, origin


Policy = Callable[[Iteration, int, float, float], SwapPlan]


@dataclass(frozen=True, slots=True)
class Plan:
    """One plan: the schedule (swaps and recomputations), its simulated timeline under the
    limit it was made for, and the placement of what it leaves on the device.

    `fits` when the schedule ran feasibly (and passed `validate_swaps`) and its placement
    (checked by `validate`) fits `limit`: the only plans that count as feasible."""

    schedule: SwapPlan
    result: Result  # the schedule simulated under `planned_for`
    combined: Combined | None  # None: the schedule is infeasible, nothing placed
    limit: Bytes  # the device bytes the plan must fit
    planned_for: Bytes  # the limit the schedule was made for: `limit` less what placing cost
    rounds: int  # schedules made

    @property
    def fits(self) -> bool:
        return self.combined is not None and self.combined.footprint <= self.limit

    @property
    def footprint(self) -> int | None:
        """The device bytes the placed plan needs; None when nothing could be placed."""
        return None if self.combined is None else int(self.combined.footprint)


def fit(
    it: Iteration,
    policy: str | Policy,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
    rounds: int = 8,
    alignment: int = ALIGNMENT,
    time_limit_s: float = 2.0,
) -> Plan:
    """The policy's plan whose footprint (placement included) fits `limit`, or, when no
    schedule tried fits, the one made for `limit` itself (`fits` False).

    A schedule keeps the live bytes under its limit; the placement of what it leaves adds
    fragmentation, so the footprint can exceed that limit, and by an amount that moves
    unevenly with the limit (the placement is a time-limited search). The schedule is made
    for `limit`, then, while its footprint is over, for a limit lower by the excess and at
    least `step` below every limit tried (0.5% of `limit`; doubled each time the footprint
    did not shrink); an infeasible schedule halves the distance to the lowest limit tried.
    At most `rounds` schedules. Each schedule passes `validate_swaps` under its own limit,
    each placement `validate`. `policy`: a name in `policies.POLICIES` or a policy."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    make: Policy = (
        (lambda it, lim, o, i: make_plan(it, policy, lim, o, i))
        if isinstance(policy, str)
        else policy
    )
    step = max(limit // 200, alignment)
    lowest, best = limit, None  # the lowest limit tried that did not fit; the least footprint
    first: Plan | None = None
    target = limit
    for k in range(1, rounds + 1):
        if target <= 0:
            break
        schedule = make(it, target, out_gbps, in_gbps)
        result = simulate(it, schedule, target, out_gbps, in_gbps, compute_scale)
        combined = None
        if result.feasible:
            validate_swaps(it, schedule, result, target, in_gbps, compute_scale)
            combined = combine(it, schedule, result, alignment, time_limit_s)
        made = Plan(schedule, result, combined, Bytes(limit), Bytes(target), k)
        if made.fits:
            return made
        first = first or made
        if combined is None:
            if k == 1 or target >= lowest - alignment:
                break  # infeasible for the limit itself, or no room left between tries
            target = (target + lowest) // 2  # too low: back towards the lowest that ran
            continue
        footprint = int(combined.footprint)
        if best is not None and footprint >= best:
            step *= 2  # no better than before: the excess is no guide here
        best = footprint if best is None else min(best, footprint)
        lowest = min(lowest, target)
        target = min(target - (footprint - limit), lowest - step)
    assert first is not None
    return replace(first, rounds=k)


def combine(
    it: Iteration,
    plan: SwapPlan,
    result: Result,
    alignment: int = ALIGNMENT,
    time_limit_s: float = 2.0,
) -> Combined:
    """Place the pieces the plan leaves (Planner I), check the placement with `validate`, and
    report the footprint."""
    split, origin = _split(it, plan, result)
    problem, _ = to_problem(split, alignment)
    placement = solve(problem, time_limit_s=time_limit_s)
    validate(problem, placement)
    resident = Bytes(sum(size for _, size in split.persistent))
    return Combined(split, placement, resident, Bytes(resident + placement.height), origin)
