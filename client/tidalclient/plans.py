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
from dataclasses import dataclass
from typing import Any

from tidalcore.units import ALIGNMENT, align_up
from tidalcore.v1 import pool_pb2
from tidalcore.wire import PAGED_PLAN_VERSION

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
class ScheduledSwap:
    """Swap one block out after an op of every iteration and back before a later op.

    `block` is the index of the allocation within the iteration (0: the first malloc after
    `step()`), or, with `persistent`, the id of a block that lives across iterations (ids never
    change). Ops are numbered from 0 within the iteration. The swap-out is
    issued when op `out_after` has ended; the swap-in when op `in_at` begins (default: the op
    before `in_before`, but not before `out_after`'s successor); op `in_before` begins only once
    the block is back. A persistent block may cross the boundary (`in_before <= out_after`): it
    leaves after `out_after` and returns before `in_before` of the next iteration.
    """

    block: int
    out_after: int
    in_before: int
    in_at: int | None = None
    persistent: bool = False

    def issue_at(self) -> int:
        """The op at whose beginning the swap-in is issued."""
        if self.in_at is not None:
            return self.in_at
        earliest = 0 if self.crosses else self.out_after + 1
        return max(self.in_before - 1, earliest)

    @property
    def crosses(self) -> bool:
        return self.in_before <= self.out_after

    def check(self) -> None:
        """ValueError naming what is inconsistent."""
        if min(self.block, self.out_after, self.in_before) < 0:
            raise ValueError(f"{self}: indices must not be negative")
        if self.crosses and not self.persistent:
            raise ValueError(f"{self}: only a persistent block may cross the iteration boundary")
        at = self.issue_at()
        ok = 0 <= at <= self.in_before if self.crosses else self.out_after < at <= self.in_before
        if not ok:
            raise ValueError(f"{self}: the swap-in must be issued between the out and in ops")


@dataclass(frozen=True, slots=True)
class Prediction:
    """The simulator's timeline of the plan's iteration (`PlanPrediction`)."""

    step_ns: int
    baseline_ns: int
    out_bytes: int
    in_bytes: int
    stall_ns: int
    peak_bytes: int
    footprint_bytes: int
    copy_gbps: float


@dataclass(frozen=True, slots=True)
class Recompute:
    """A hint: allocation `block` may be dropped after op `drop_after` and rebuilt before op
    `before` (the placement leaves room for it)."""

    block: int
    drop_after: int
    before: int


VERSION = PAGED_PLAN_VERSION
"""The newest `PlanUpdate.version` this client knows (`tidalcore.wire`; pool.proto's version
rule)."""


@dataclass(frozen=True, slots=True)
class Paging:
    """A version-3 plan's virtual residency: every allocation keeps one address for life.
    `table`'s offsets are then the allocations' addresses in the plan's region (`region_bytes`
    long, whole pages of `page` bytes); `owning[i]`: allocation i has whole pages of its own
    (only such blocks move); `mapped_peak`: the most bytes the planner counted mapped."""

    page: int
    owning: tuple[bool, ...]
    region_bytes: int
    mapped_peak: int


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
    paging: Paging | None = None  # version 3: the table's offsets are addresses for life

    @property
    def plan_id(self) -> int:
        return self.table.plan_id

    @property
    def places_swaps(self) -> bool:
        """Whether the plan says where every swap-in lands (else the client places them)."""
        return bool(self.swaps) and len(self.swap_in_offsets) == len(self.swaps)


def decode(update: pool_pb2.PlanUpdate, alignment: int = ALIGNMENT) -> Plan:
    """The plan a `PlanUpdate` carries. PlanRejected when its placement is unusable; a
    malformed swap schedule (columns of unequal lengths, an inconsistent swap) is logged and
    left out, and the placement is kept; so are swap-in offsets that do not match the
    schedule (the swap-ins are then placed here). Fields of a version newer than `VERSION`
    are not read (the version rule: they only add to what the known ones say)."""
    paging = _paging(update) if update.version >= 3 and update.page_bytes else None
    if paging is not None:
        table = PlanTable.build(
            update.plan_id,
            list(update.sizes),
            list(update.addresses),
            paging.region_bytes,
            alignment,
        )
    else:
        table = PlanTable.build(
            update.plan_id, list(update.sizes), list(update.offsets), update.height_bytes, alignment
        )
    swaps = _swaps(update)
    offsets: tuple[int, ...] = tuple(update.swap_in_offsets)
    if offsets and (
        len(offsets) != len(swaps)
        or any(o % alignment or o >= update.height_bytes for o in offsets)
    ):
        log.warning(
            "tidalpool: plan %d: %d swap-in offsets for %d swaps, or one misaligned or beyond"
            " its height: the swap-ins are placed here",
            update.plan_id,
            len(offsets),
            len(swaps),
        )
        offsets = ()
    ticks: tuple[int, ...] = tuple(update.swap_in_ticks)
    if len(ticks) != (len(swaps) if paging is not None else len(offsets)):
        ticks = ()
    prediction = None
    if update.HasField("prediction"):
        p = update.prediction
        prediction = Prediction(
            p.step_ns,
            p.baseline_ns,
            p.out_bytes,
            p.in_bytes,
            p.stall_ns,
            p.peak_bytes,
            p.footprint_bytes,
            p.copy_gbps,
        )
    columns = (update.recompute_blocks, update.recompute_drop_after, update.recompute_before)
    recomputes: tuple[Recompute, ...] = ()
    if len({len(c) for c in columns}) == 1:
        recomputes = tuple(Recompute(*r) for r in zip(*columns, strict=True))
    return Plan(
        table,
        swaps,
        offsets,
        ticks,
        recomputes,
        update.version or 1,
        update.limit_bytes,
        prediction,
        paging,
    )


def _paging(update: pool_pb2.PlanUpdate) -> Paging:
    """The virtual residency of a version-3 update; PlanRejected for one no session can run."""
    page, region = update.page_bytes, update.region_bytes
    sizes, addresses, owning = update.sizes, update.addresses, update.owning
    if page % ALIGNMENT or page & (page - 1) or region % page:
        raise PlanRejected(
            f"plan {update.plan_id}: a page of {page} bytes (a power of two, a multiple of"
            f" {ALIGNMENT}) and a region of {region} bytes (whole pages)"
        )
    if not len(sizes) == len(addresses) == len(owning):
        raise PlanRejected(
            f"plan {update.plan_id}: {len(sizes)} sizes, {len(addresses)} addresses and"
            f" {len(owning)} owning flags"
        )
    for i, (address, own) in enumerate(zip(addresses, owning, strict=True)):
        if own and address % page:
            raise PlanRejected(
                f"plan {update.plan_id}: allocation {i} owns pages but lies at {address},"
                f" not on a page of {page} bytes"
            )
    return Paging(page, tuple(owning), region, update.mapped_peak_bytes)


def _swaps(update: pool_pb2.PlanUpdate) -> tuple[ScheduledSwap, ...]:
    columns: Sequence[Sequence[Any]] = (
        update.swap_blocks,
        update.swap_persistent,
        update.swap_out_after,
        update.swap_in_at,
        update.swap_in_before,
    )
    try:
        swaps = tuple(
            ScheduledSwap(block, out_after, in_before, in_at, persistent)
            for block, persistent, out_after, in_at, in_before in zip(*columns, strict=True)
        )
        for swap in swaps:
            swap.check()
    except ValueError as e:
        log.warning("tidalpool: ignoring the swap schedule of plan %d: %s", update.plan_id, e)
        return ()
    return swaps


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
