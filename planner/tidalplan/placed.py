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
at that op. A persistent block that is swapped becomes pieces too, one per
swap-in, the one on the device across the iteration's boundary a single
crossing piece; one that is not swapped keeps its own bytes outside the
placement.

The footprint of the plan is those persistent bytes plus the placement's
height: what the device must really hold, fragmentation included. It can exceed
the limit the schedule was made for; `fit` makes the schedule again for lower
limits until the footprint fits. A `Plan` is feasible (`fits`) only then: its
schedule ran under the simulator, passed `validate_swaps`, and its placement,
checked by `validate`, fits the limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from tidalcore.units import ALIGNMENT, Bytes, Tick

from tidalplan.learn import to_problem
from tidalplan.model import Iteration, IterBlock, Placement, SwapPlan
from tidalplan.placement import solve, time_left
from tidalplan.simulate import Result, rebuilds, simulate
from tidalplan.validate import validate, validate_swaps

BLOCK, PERSISTENT, SCRATCH = "block", "persistent", "scratch"


@dataclass(frozen=True, slots=True)
class Combined:
    pieces: Iteration  # the iteration with swapped blocks split into their device pieces
    placement: Placement  # of the buffers of `to_problem(pieces)` (zero-size pieces left out)
    resident_persistent: Bytes  # persistent bytes never swapped
    footprint: Bytes  # resident_persistent + placement.height
    # Piece id -> what it holds: (BLOCK, index in `Iteration.blocks`), (PERSISTENT, index in
    # `Iteration.persistent`) or (SCRATCH, the op tick of its rebuild).
    origin: dict[int, tuple[str, int]] = field(default_factory=dict, compare=False)
    # Per swap of the schedule (in plan order): the id of the piece whose life starts at its
    # swap-in (the block's bytes until its next swap-out or its free).
    in_pieces: tuple[int, ...] = ()
    # Per transient block (index in `Iteration.blocks`): the id of its first piece, the one
    # its malloc starts (the block itself when it is never away).
    first_pieces: dict[int, int] = field(default_factory=dict, compare=False)


class Split(NamedTuple):
    """An iteration split into device pieces, and what each piece is (see `Combined`)."""

    pieces: Iteration
    origin: dict[int, tuple[str, int]]
    in_pieces: tuple[int, ...]
    first_pieces: dict[int, int]


def pieces(it: Iteration, plan: SwapPlan, result: Result) -> Iteration:
    """`it` with every swapped or dropped block replaced by its device pieces (ids from max
    id + 1), and a piece for each rebuild's scratch."""
    return split(it, plan, result).pieces


def split(it: Iteration, plan: SwapPlan, result: Result) -> Split:
    """The device pieces of `it` under `plan` as `result` simulated it, and which piece is
    which: each piece's origin, the piece each swap-in starts, each block's first piece.

    A transient block's pieces are its first (from its malloc to its first release) and one
    from each return (a swap-in, or a rebuild) to its next release or its free. A swapped
    persistent block has one piece per swap-in, each until the next swap-out's release; the
    one that is on the device across the iteration's boundary is one crossing piece
    (`IterBlock.crosses`, ending at `ticks` + the first release of the next iteration), as
    its bytes cannot move there without a copy:

        tick     0      r1         c1          r2       c2        T      T+r1
        block    ███████┘          └███████████┘         └█████████│██████┘   away: [r1, c1),
        pieces   (the previous     [c1 ....... r2)       [c2 .............. T+r1)    [r2, c2)
                  iteration's)                           one crossing piece
    """
    if not result.feasible:
        raise ValueError("the plan is infeasible under its limit: nothing to place")
    if len(result.swap_ticks) != len(plan.swaps):
        raise ValueError("the result is not the simulation of this plan on this iteration")
    # (persistent, block) -> (release tick, back tick, swap index or -1 for a recomputation)
    away: dict[tuple[bool, int], list[tuple[int, int, int]]] = {}
    for j, (s, (gone, back)) in enumerate(zip(plan.swaps, result.swap_ticks, strict=True)):
        # Tick `gone` is the first to see the bytes free; the swap-in started after tick
        # back - 1 had happened, so the piece is live from there.
        away.setdefault((s.persistent, s.block), []).append((gone, max(back - 1, 0), j))
    for r in plan.recomputes:  # rebuilt at op `before`, after every earlier tick
        away.setdefault((False, r.block), []).append((r.drop_after + 1, r.before, -1))
    next_id = max([b.id for b in it.blocks] + [p for p, _ in it.persistent] + [0]) + 1
    blocks: list[IterBlock] = []
    origin: dict[int, tuple[str, int]] = {}
    in_pieces = [-1] * len(plan.swaps)
    first_pieces: dict[int, int] = {}

    def add(piece: IterBlock, what: tuple[str, int], swap: int = -1) -> None:
        nonlocal next_id
        blocks.append(piece)
        origin[piece.id] = what
        if swap >= 0:
            in_pieces[swap] = piece.id
        next_id = max(next_id, piece.id + 1)

    for i, b in enumerate(it.blocks):
        gaps = sorted(away.get((False, i), ()))
        if not gaps:
            add(b, (BLOCK, i))
            first_pieces[i] = b.id
            continue
        lo, came = int(b.start), -1  # the piece's start; the swap that began it
        for release, back, j in gaps:
            add(IterBlock(next_id, b.size, Tick(lo), Tick(max(release, lo + 1))), (BLOCK, i), came)
            first_pieces.setdefault(i, blocks[-1].id)
            lo, came = back, j
        add(IterBlock(next_id, b.size, Tick(lo), b.end, crosses=b.crosses), (BLOCK, i), came)
    resident: list[tuple[int, Bytes]] = []
    for k, (pid, size) in enumerate(it.persistent):
        # In out_after order the swap that crosses the boundary, if any, is the last. Each
        # swap-in's piece lasts until the next swap's release; the last one's, when it does
        # not cross, until the first release of the next iteration.
        mine = sorted(away.get((True, k), ()), key=lambda g: plan.swaps[g[2]].out_after)
        if not mine:
            resident.append((pid, size))
            continue
        for n, (_, back, j) in enumerate(mine):
            s = plan.swaps[j]
            if n + 1 < len(mine):
                end, crosses = mine[n + 1][0], False
            elif s.in_before <= s.out_after:  # it crosses: back before the first swap-out
                end, crosses = mine[0][0], False
            else:
                end, crosses = it.ticks + mine[0][0], True
            add(IterBlock(next_id, size, Tick(back), Tick(end), crosses), (PERSISTENT, k), j)
    durations: dict[int, int] = {int(op.tick): op.duration_ns for op in it.ops}
    for before, rebuild in sorted(rebuilds(it, plan, durations).items()):
        if rebuild.scratch:  # held while the rebuild runs, before the op at `before`
            scratch = IterBlock(next_id, Bytes(rebuild.scratch), Tick(before), Tick(before + 1))
            add(scratch, (SCRATCH, before))
    blocks.sort(key=lambda b: (b.start, b.id))
    pieces_of = Iteration(
        ticks=it.ticks,
        blocks=tuple(blocks),
        ops=it.ops,
        accesses=(),
        persistent=tuple(resident),
        index=it.index,
    )
    return Split(pieces_of, origin, tuple(in_pieces), first_pieces)


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
    limit: Bytes  # the device bytes the plan must fit; 0: no limit (`unlimited`)
    planned_for: Bytes  # the limit the schedule was made for: `limit` less what placing cost
    rounds: int  # schedules made

    @property
    def fits(self) -> bool:
        return self.combined is not None and (
            not self.limit or self.combined.footprint <= self.limit
        )

    @property
    def footprint(self) -> int | None:
        """The device bytes the placed plan needs; None when nothing could be placed."""
        return None if self.combined is None else int(self.combined.footprint)


def fit(
    it: Iteration,
    policy: Policy,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
    rounds: int = 8,
    alignment: int = ALIGNMENT,
    time_limit_s: float = 2.0,
    budget_s: float | None = None,
) -> Plan:
    """The policy's plan whose footprint (placement included) fits `limit`, or, when no
    schedule tried fits, the one made for `limit` itself (`fits` False). `budget_s`: no
    round is started once that many seconds have passed since the call (the first always
    is), as if `rounds` had run out, and no placement solve runs past them (`time_left`).

    A schedule keeps the live bytes under its limit; the placement of what it leaves adds
    fragmentation, so the footprint can exceed that limit, and by an amount that moves
    unevenly with the limit (the placement is a time-limited search). The schedule is made
    for `limit`, then, while its footprint is over, for a limit lower by the excess and at
    least `step` below every limit tried (0.5% of `limit`; doubled each time the footprint
    did not shrink); an infeasible schedule halves the distance to the lowest limit tried.
    At most `rounds` schedules. Each schedule passes `validate_swaps` under its own limit,
    each placement `validate`. `policy` makes a schedule (`combined.fit` takes a policy's
    name too)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")

    step = max(limit // 200, alignment)
    lowest, best = limit, None  # the lowest limit tried that did not fit; the least footprint
    first: Plan | None = None
    target = limit
    started = time.monotonic()
    for k in range(1, rounds + 1):
        if target <= 0:
            break
        if k > 1 and budget_s is not None and time.monotonic() - started >= budget_s:
            k -= 1  # this round does not run
            break
        schedule = policy(it, target, out_gbps, in_gbps)
        result = simulate(it, schedule, target, out_gbps, in_gbps, compute_scale)
        combined = None
        if result.feasible:
            validate_swaps(it, schedule, result, target, in_gbps, compute_scale)
            seconds = time_left(time_limit_s, budget_s, started)
            combined = combine(it, schedule, result, alignment, seconds)
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


def unlimited(
    it: Iteration,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
    alignment: int = ALIGNMENT,
    time_limit_s: float = 2.0,
) -> Plan:
    """The plan for no limit (`limit` 0, so it always `fits`): no schedule, every block placed
    whole, simulated with no limit."""
    schedule = SwapPlan()
    result = simulate(it, schedule, None, out_gbps, in_gbps, compute_scale)
    placed = combine(it, schedule, result, alignment, time_limit_s)
    return Plan(schedule, result, placed, Bytes(0), Bytes(0), 1)


def combine(
    it: Iteration,
    plan: SwapPlan,
    result: Result,
    alignment: int = ALIGNMENT,
    time_limit_s: float = 2.0,
) -> Combined:
    """Place the pieces the plan leaves (Planner I), check the placement with `validate`, and
    report the footprint."""
    parts = split(it, plan, result)
    problem, _ = to_problem(parts.pieces, alignment)
    placement = solve(problem, time_limit_s=time_limit_s)
    validate(problem, placement)
    resident = Bytes(sum(size for _, size in parts.pieces.persistent))
    return Combined(
        parts.pieces,
        placement,
        resident,
        Bytes(resident + placement.height),
        parts.origin,
        parts.in_pieces,
        parts.first_pieces,
    )
