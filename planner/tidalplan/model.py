"""The values the planner passes around.

Time is measured in ticks: the index of an event (alloc, free or op) within an
iteration's event stream. A block allocated at tick a and freed at tick f is
live over [a, f); two blocks may share bytes only if their lifetimes do not
intersect. Because a free and a later alloc are different ticks, a block freed
before another is allocated between the same two ops never overlaps it, which
is exactly the reuse an allocator can honour at run time (Layrub's intra-layer
reuse at the granularity the trace gives).

    address
      ▲   ┌────────┐
      │   │   b2   │        ┌──────┐
      │ ┌─┴──────┬─┘        │  b3  │     a placement: each buffer a rectangle
      │ │   b1   │          └──────┘     [lower, upper) × [offset, offset+size)
      └─┴────────┴───────────────────▶ tick
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidalcore.units import Bytes, Offset, Tick


@dataclass(frozen=True, slots=True)
class Buffer:
    """One rectangle of a placement problem: `size` bytes live over [lower, upper)."""

    id: int
    lower: Tick
    upper: Tick
    size: Bytes

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"buffer {self.id}: size must be positive, got {self.size}")
        if self.upper <= self.lower:
            raise ValueError(f"buffer {self.id}: empty lifetime [{self.lower}, {self.upper})")


@dataclass(frozen=True, slots=True)
class Problem:
    """Buffers to place; offsets must be multiples of `alignment`."""

    buffers: tuple[Buffer, ...]
    alignment: int = 1


@dataclass(frozen=True, slots=True)
class Placement:
    """Offsets parallel to `Problem.buffers`, the height they reach, and who made them."""

    offsets: tuple[Offset, ...]
    height: Bytes
    solver: str
    optimal: bool = False  # proven: height equals a lower bound, or an exact search finished
    stats: dict[str, float] = field(default_factory=dict, compare=False)


@dataclass(frozen=True, slots=True)
class Access:
    """An op reads or writes a block."""

    tick: Tick  # the op's tick
    block: int
    write: bool


@dataclass(frozen=True, slots=True)
class IterBlock:
    """A block allocated and freed within the iteration (or crossing its boundary)."""

    id: int  # block id in the trace
    size: Bytes
    start: Tick  # alloc tick
    end: Tick  # free tick; for a block freed in the next iteration: `ticks` + its free tick there
    crosses: bool = False  # allocated here, freed in the next iteration


@dataclass(frozen=True, slots=True)
class Op:
    tick: Tick
    name: str
    duration_ns: int


@dataclass(frozen=True, slots=True)
class Iteration:
    """One steady training iteration, as learned from the event stream.

    `blocks` are in allocation order: allocation i of the iteration is blocks[i].
    `persistent` are live across every iteration (weights, optimizer state): their
    ids and sizes; they are not part of the per-iteration placement.
    `boundary_swaps=False`: no persistent block may be away across the iteration's boundary
    (it is followed by iterations of other shapes, whose plans find every persistent block on
    the device where they begin).
    """

    ticks: int  # events (alloc, free, op) in the iteration
    blocks: tuple[IterBlock, ...]
    ops: tuple[Op, ...]
    accesses: tuple[Access, ...]
    persistent: tuple[tuple[int, Bytes], ...]
    index: int = 0  # which iteration of the stream it is (0-based)
    boundary_swaps: bool = True


@dataclass(frozen=True, slots=True)
class Swap:
    """Swap a block out after one op and back in before a later one.

    `block` indexes `Iteration.blocks`, or `Iteration.persistent` when
    `persistent` is set. `out_after` and `in_before` are op ticks: the swap-out
    starts once op `out_after` has finished; op `in_before` cannot start until
    the swap-in has finished. The swap-in is issued when compute reaches tick
    `in_at`: by default the op before `in_before`, but no earlier than the tick
    after `out_after` (or tick 0 for a swap that crosses the boundary). It never
    starts before its own swap-out has finished.

    A persistent block may cross the iteration boundary (`in_before` <=
    `out_after`): it is then off the device when the iteration begins, comes back
    before `in_before`, and leaves again after `out_after`, as in the steady state.
    The block must not be accessed strictly between `out_after` and `in_before`.
    """

    block: int
    out_after: Tick
    in_before: Tick
    in_at: Tick | None = None
    persistent: bool = False


@dataclass(frozen=True, slots=True)
class Recompute:
    """Drop a transient block after one op and rebuild it before a later one.

    `block` indexes `Iteration.blocks`. Its bytes leave the device when op
    `drop_after` ends (no copy). Right before op `before` (and after that op's
    swap-ins have arrived) compute runs again the block's *writers*: the ops that
    wrote it at ticks in [start, drop_after], in tick order. Every recomputation
    with the same `before` is one rebuild: the union of their writers, run once
    each, in tick order. The rebuild needs, at its start, the rebuilt blocks'
    bytes and scratch for every other block its ops write (written to scratch, so
    nothing resident is overwritten), the scratch freed at its end; each block a
    writer reads is rebuilt in the same rebuild or is on the device at `before`
    (live, not swapped out or dropped) and not written at any tick from that
    writer's tick to `before`. It costs the writers' durations on the compute
    stream. The block must not be accessed strictly between the two ops.
    """

    block: int
    drop_after: Tick
    before: Tick


@dataclass(frozen=True, slots=True)
class SwapPlan:
    """The swaps and recomputations of one iteration: the schedule.

    A block may be swapped (or dropped) more than once, over intervals that do not
    overlap: one swap's `in_before` is at or before the next one's `out_after` (a
    crossing swap of a persistent block holds the ends of the iteration, the others lie
    between its `in_before` and its `out_after`); a recomputation's interval
    (`drop_after`, `before`) counts the same way."""

    swaps: tuple[Swap, ...] = ()
    recomputes: tuple[Recompute, ...] = ()
