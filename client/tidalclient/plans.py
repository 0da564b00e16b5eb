"""A plan as the client executes it: the daemon's `PlanUpdate`, decoded and checked once.

    PlanUpdate ──decode()──▶ Plan ──Executor.install_plan()──▶ used from the next step()
                              ├─ table: PlanTable   the placement: size and offset per allocation
                              ├─ swaps: ScheduledSwap...   the swap schedule (under a swap limit)
                              ├─ swap_in_offsets    where each swap-in lands (version 2)
                              └─ prediction         the simulator's timeline of the plan

The table lists, in allocation order, the size and offset of every allocation of the steady
iteration; offsets are relative to an *arena*, one range of the lease reserved for the plan
(`executors/arena.py`). Each slot comes with the other slots sharing any of its bytes, so the
hot path checks a slot in O(those slots).

A swapped block is on the device in pieces: its allocation's slot until its first swap-out,
then, from each swap-in on, the piece that swap-in fills. The swap engine adds those pieces to
the table as slots after the allocations' (`with_pieces`), once it knows the sizes of the
persistent blocks among them; their overlaps are computed over all slots together.

Pure: no I/O, no threads, no clock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from tidalcore import planupdate
from tidalcore.planupdate import Pages, Prediction, Recompute, ScheduledSwap
from tidalcore.units import ALIGNMENT, align_up
from tidalcore.v1 import pool_pb2

log = logging.getLogger("tidalpool")


class PlanRejected(ValueError):
    """A plan the client cannot use (inconsistent lengths, misaligned or out-of-range slots)."""


@dataclass(frozen=True, slots=True)
class PlanTable:
    plan_id: int
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    height: int
    overlaps: tuple[tuple[int, ...], ...]  # per slot: the other slots sharing any of its bytes
    # Slots after the allocations' (slot len(sizes) + j): (size, offset) of swap j's piece.
    pieces: tuple[tuple[int, int], ...] = ()

    @classmethod
    def build(
        cls,
        plan_id: int,
        sizes: list[int],
        offsets: list[int],
        height: int,
        alignment: int,
        pieces: Sequence[tuple[int, int]] = (),
    ) -> PlanTable:
        if len(sizes) != len(offsets):
            raise PlanRejected(f"plan {plan_id}: {len(sizes)} sizes but {len(offsets)} offsets")
        slots = [*zip(sizes, offsets, strict=True), *pieces]
        for i, (size, offset) in enumerate(slots):
            if size <= 0 or offset % alignment or offset + align_up(size, alignment) > height:
                what = f"slot {i}" if i < len(sizes) else f"the piece of swap {i - len(sizes)}"
                raise PlanRejected(
                    f"plan {plan_id}: {what} ({size} bytes at offset {offset}) is empty, "
                    f"misaligned or beyond the plan's height {height}"
                )
        all_sizes = [size for size, _ in slots]
        all_offsets = [offset for _, offset in slots]
        return cls(
            plan_id,
            tuple(sizes),
            tuple(offsets),
            height,
            _overlaps(all_sizes, all_offsets, alignment),
            tuple(pieces),
        )

    def with_pieces(self, pieces: Sequence[tuple[int, int]], alignment: int) -> PlanTable:
        """This table with a slot for each swap's piece, (size, offset) in swap order."""
        return PlanTable.build(
            self.plan_id, list(self.sizes), list(self.offsets), self.height, alignment, pieces
        )


def _overlaps(sizes: list[int], offsets: list[int], alignment: int) -> tuple[tuple[int, ...], ...]:
    """For each slot, the slots whose byte ranges intersect it (sweep over sorted starts)."""
    order = sorted(range(len(sizes)), key=lambda i: offsets[i])
    found: list[list[int]] = [[] for _ in sizes]
    active: list[int] = []  # slots whose range may still reach the current start
    for i in order:
        start = offsets[i]
        active = [j for j in active if offsets[j] + align_up(sizes[j], alignment) > start]
        for j in active:
            found[i].append(j)
            found[j].append(i)
        active.append(i)
    return tuple(tuple(sorted(f)) for f in found)


@dataclass(frozen=True, slots=True)
class Plan:
    """One plan of the daemon: where each allocation goes and, under a swap limit, which
    blocks leave the device between their uses and where each comes back."""

    table: PlanTable
    swaps: tuple[ScheduledSwap, ...] = ()
    swap_in_offsets: tuple[int, ...] = ()  # per swap: the arena offset its swap-in fills
    # Per swap: the event of the iteration (allocs, frees and ops from 0) after which its
    # swap-in starts and its piece is held; empty: when op `in_at` begins.
    swap_in_ticks: tuple[int, ...] = ()
    recomputes: tuple[Recompute, ...] = ()
    version: int = 1
    limit: int = 0  # the device bytes the plan was made to fit (0: no swap limit)
    prediction: Prediction | None = None
    paging: Pages | None = None  # version 3: the table's offsets are its addresses for life
    shape: str = ""  # the iteration shape it was made for (StepMark.shape)
    # The message it came in (what a tool re-simulates it from); not part of its value.
    update: pool_pb2.PlanUpdate | None = field(default=None, compare=False, repr=False)

    @property
    def plan_id(self) -> int:
        return self.table.plan_id

    @property
    def places_swaps(self) -> bool:
        """Whether the plan says where every swap-in lands (else the client places them)."""
        return bool(self.swaps) and len(self.swap_in_offsets) == len(self.swaps)


def decode(update: pool_pb2.PlanUpdate, alignment: int = ALIGNMENT) -> Plan:
    """The plan a `PlanUpdate` carries (`tidalcore.planupdate.read`). PlanRejected names
    what no session could run: a column `read` refuses, or a slot misaligned or past the
    plan's height or region. Fields of a version newer than `VERSION` are not read (the
    version rule: they only add to what the known ones say)."""
    try:
        c = planupdate.read(update)
        planupdate.check_swaps(c.swaps)
    except planupdate.PlanError as e:
        raise PlanRejected(f"plan {update.plan_id}: {e}") from e
    placement = c.placement
    paging: Pages | None = None
    offsets: tuple[int, ...] = ()
    if isinstance(placement, Pages):
        table = PlanTable.build(
            c.plan_id, list(c.sizes), list(placement.addresses), placement.region_bytes, alignment
        )
        paging, offsets = placement, ()
    else:
        table = PlanTable.build(
            c.plan_id, list(c.sizes), list(placement.offsets), placement.height, alignment
        )
        paging, offsets = None, placement.swap_in_offsets
        for j, o in enumerate(offsets):
            if o % alignment or o >= placement.height:
                raise PlanRejected(
                    f"plan {c.plan_id}: swap {j}'s swap-in lands at {o}, misaligned or past the"
                    f" plan's height {placement.height}"
                )
    return Plan(
        table,
        c.swaps,
        offsets,
        c.swap_in_ticks,
        c.recomputes,
        c.version,
        c.limit,
        c.prediction,
        paging,
        update.shape,
        update,
    )


@dataclass(frozen=True, slots=True)
class OpSchedule:
    """A swap schedule by op index, as an executor runs it: the swaps (by index) out after
    op k, in issued at op k, and waited for by op k; with `slots`, the plan slot of each
    swap's piece (a contiguous arena's)."""

    refs: tuple[tuple[bool, int], ...]  # per swap: (persistent, allocation index or block id)
    slots: tuple[int, ...]  # per swap: its piece's slot; empty: swap-ins placed online
    out_after: tuple[int, ...]  # per swap
    in_before: tuple[int, ...]
    starts: tuple[int, ...]  # per swap: the event its swap-in starts after; empty: at in_at
    outs_after: dict[int, tuple[int, ...]]
    ins_at: dict[int, tuple[int, ...]]
    needed_before: dict[int, tuple[int, ...]]

    @property
    def swaps(self) -> int:
        return len(self.refs)

    @classmethod
    def build(
        cls,
        swaps: Sequence[ScheduledSwap],
        first_slot: int | None = None,
        starts: Sequence[int] = (),
    ) -> OpSchedule:
        """`first_slot`: the slot of swap 0's piece (the plan's allocations come before);
        `starts`: per swap, the event its swap-in starts after."""
        by_op: tuple[dict[int, list[int]], ...] = ({}, {}, {})
        for j, s in enumerate(swaps):
            s.check()
            for table, k in zip(by_op, (s.out_after, s.issue_at(), s.in_before), strict=True):
                table.setdefault(k, []).append(j)
        outs, ins, needed = ({k: tuple(v) for k, v in t.items()} for t in by_op)
        refs = tuple((s.persistent, s.block) for s in swaps)
        slots = () if first_slot is None else tuple(range(first_slot, first_slot + len(swaps)))
        after = tuple(s.out_after for s in swaps)
        before = tuple(s.in_before for s in swaps)
        return cls(refs, slots, after, before, tuple(starts), outs, ins, needed)
