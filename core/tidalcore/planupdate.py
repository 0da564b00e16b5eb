"""The PlanUpdate codec: a plan's columns as the daemon writes them and a session reads them.

    tidalplan.wire ──write()──▶ PlanUpdate ──read()──▶ Columns ──▶ tidalclient.plans (run it)
                                                          └──────▶ tidalplan.wire (check it,
                                                                   on the iteration's ticks)

The one home of what both ends agree on: the versions, the columns a plan of each version
carries, and what each must satisfy on its own (lengths, pages, alignment, every swap-in
issued between its swap-out and its use). What needs more than the update is checked by the
end that has it: the planner checks a plan against the iteration it was made for, the client
its placement against its lease.

- Version 2 (`ARENA_VERSION`): every piece of memory at an offset of the plan's arena, one
  range of the lease (`Arena`).
- Version 3 (`PAGED_VERSION`): virtual residency; every allocation at one address for life,
  the limit counting mapped pages (`Pages`).

pool.proto's version rule: a field of a later version only adds to what the earlier ones say,
so a reader reads a newer update as the newest version it knows.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidalcore.pages import pages_of
from tidalcore.units import ALIGNMENT
from tidalcore.v1 import pool_pb2

ARENA_VERSION = 2
"""A plan for a contiguous lease: every piece of memory at an offset of the plan's arena."""
PAGED_VERSION = 3
"""A plan for a session under virtual residency: every allocation at an address for life,
the limit counting mapped pages."""
VERSION = PAGED_VERSION
"""The newest version written and read here."""


class PlanError(ValueError):
    """An update no session can run: its message names the first column at fault."""


@dataclass(frozen=True, slots=True)
class ScheduledSwap:
    """Swap one block out after an op of every iteration and back before a later op.

    `block` is the index of the allocation within the iteration (0: the first malloc after a
    step), or, with `persistent`, the id of a block that lives across iterations (ids never
    change). Ops are numbered from 0 within the iteration. The swap-out is issued when op
    `out_after` has ended; the swap-in when op `in_at` begins (default: the op before
    `in_before`, but not before `out_after`'s successor); op `in_before` begins only once the
    block is back. A persistent block may cross the boundary (`in_before <= out_after`): it
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
class Recompute:
    """A hint: allocation `block` may be dropped after op `drop_after` and rebuilt before op
    `before` (the placement leaves room for it)."""

    block: int
    drop_after: int
    before: int


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

    @classmethod
    def of(cls, p: pool_pb2.PlanPrediction) -> Prediction:
        return cls(
            p.step_ns,
            p.baseline_ns,
            p.out_bytes,
            p.in_bytes,
            p.stall_ns,
            p.peak_bytes,
            p.footprint_bytes,
            p.copy_gbps,
        )

    def message(self) -> pool_pb2.PlanPrediction:
        return pool_pb2.PlanPrediction(
            step_ns=self.step_ns,
            baseline_ns=self.baseline_ns,
            out_bytes=self.out_bytes,
            in_bytes=self.in_bytes,
            stall_ns=self.stall_ns,
            peak_bytes=self.peak_bytes,
            footprint_bytes=self.footprint_bytes,
            copy_gbps=self.copy_gbps,
        )


@dataclass(frozen=True, slots=True)
class Arena:
    """A version-2 placement: allocation i's first piece at `offsets[i]` of an arena
    `height` bytes tall; swap j's swap-in fills the piece at `swap_in_offsets[j]`; the
    persistent blocks outside the arena hold `resident_persistent` bytes."""

    offsets: tuple[int, ...]
    height: int
    swap_in_offsets: tuple[int, ...] = ()
    resident_persistent: int = 0


@dataclass(frozen=True, slots=True)
class Pages:
    """A version-3 placement: allocation i keeps `addresses[i]` for life, in bytes from the
    start of the plan's region (`region_bytes` long, whole pages of `page` bytes);
    `owning[i]`: it has whole pages of its own (only such blocks move); `mapped_peak`: the
    most bytes the planner counted mapped."""

    page: int
    addresses: tuple[int, ...]
    owning: tuple[bool, ...]
    region_bytes: int
    mapped_peak: int


@dataclass(frozen=True, slots=True)
class Columns:
    """What a PlanUpdate says, read and checked on its own.

    `swap_in_ticks[j]`: the event of the iteration (its allocs, frees and ops, numbered from
    0) after which swap j's swap-in starts (empty: when op `in_at` begins)."""

    plan_id: int
    version: int
    sizes: tuple[int, ...]
    placement: Arena | Pages
    swaps: tuple[ScheduledSwap, ...] = ()
    swap_in_ticks: tuple[int, ...] = ()
    recomputes: tuple[Recompute, ...] = ()
    limit: int = 0  # the device bytes (version 3: mapped bytes) the plan fits; 0: no limit
    signature: bytes = b""  # of the iteration the plan was made for
    prediction: Prediction | None = None


def read(update: pool_pb2.PlanUpdate, ops: int | None = None) -> Columns:
    """`update`'s columns; PlanError names the first that no session could run: columns of
    unequal lengths, an allocation index past `sizes`, an op index past `ops` (the
    iteration's ops, where the reader knows them), a
    page that is not a power of two of at least ALIGNMENT bytes, a region that is not whole
    pages, an address off its alignment or past the region, a version-2 field in a version-3
    plan or a recomputation in one (a paged session only swaps)."""
    sizes = tuple(int(s) for s in update.sizes)
    version = update.version or 1
    swaps = _swaps(update, len(sizes), ops)
    placement: Arena | Pages
    if version >= PAGED_VERSION and update.page_bytes:
        placement = _pages(update, sizes)
    else:
        placement = _arena(update, sizes, len(swaps))
    ticks = tuple(int(t) for t in update.swap_in_ticks)
    paged = isinstance(placement, Pages)  # its swap-ins start after their ticks, always said
    if len(ticks) != len(swaps) and (ticks or paged):
        raise PlanError("the swap columns (swap_in_ticks included) differ in length")
    recomputes = _recomputes(update, len(sizes), ops)
    if isinstance(placement, Pages):
        if recomputes:
            raise PlanError("recompute_blocks is set: a paged plan only swaps blocks")
        for k, s in enumerate(swaps):
            if not s.persistent and not (s.block < len(sizes) and placement.owning[s.block]):
                raise PlanError(
                    f"swap_blocks[{k}] = {s.block}: the allocation shares pages, and never moves"
                )
    return Columns(
        plan_id=update.plan_id,
        version=version,
        sizes=sizes,
        placement=placement,
        swaps=swaps,
        swap_in_ticks=ticks,
        recomputes=recomputes,
        limit=int(update.limit_bytes),
        signature=bytes(update.signature),
        prediction=Prediction.of(update.prediction) if update.HasField("prediction") else None,
    )


def check_swaps(swaps: Sequence[ScheduledSwap]) -> None:
    """PlanError naming the first swap whose swap-in is not issued between its swap-out and
    its use (`ScheduledSwap.check`): what a session that runs the swaps needs. The planner
    checks more (`tidalplan.validate.validate_swaps`: the swaps against the iteration's
    accesses and the limit)."""
    for k, swap in enumerate(swaps):
        try:
            swap.check()
        except ValueError as e:
            raise PlanError(f"swap {k}: {e}") from e


def write(c: Columns) -> pool_pb2.PlanUpdate:
    """`c` as a PlanUpdate; `read` gives it back."""
    update = pool_pb2.PlanUpdate(
        plan_id=c.plan_id,
        version=c.version,
        signature=c.signature,
        sizes=c.sizes,
        limit_bytes=c.limit,
        swap_blocks=[s.block for s in c.swaps],
        swap_persistent=[s.persistent for s in c.swaps],
        swap_out_after=[s.out_after for s in c.swaps],
        swap_in_at=[s.issue_at() for s in c.swaps],
        swap_in_before=[s.in_before for s in c.swaps],
        swap_in_ticks=c.swap_in_ticks,
        recompute_blocks=[r.block for r in c.recomputes],
        recompute_drop_after=[r.drop_after for r in c.recomputes],
        recompute_before=[r.before for r in c.recomputes],
    )
    p = c.placement
    if isinstance(p, Pages):
        update.page_bytes = p.page
        update.addresses.extend(p.addresses)
        update.owning.extend(p.owning)
        update.region_bytes = p.region_bytes
        update.mapped_peak_bytes = p.mapped_peak
    else:
        update.offsets.extend(p.offsets)
        update.height_bytes = p.height
        update.swap_in_offsets.extend(p.swap_in_offsets)
        update.resident_persistent_bytes = p.resident_persistent
    if c.prediction is not None:
        update.prediction.CopyFrom(c.prediction.message())
    return update


def _arena(update: pool_pb2.PlanUpdate, sizes: tuple[int, ...], swaps: int) -> Arena:
    if len(update.offsets) != len(sizes):
        raise PlanError(f"{len(update.offsets)} offsets for {len(sizes)} allocations")
    offsets = tuple(int(o) for o in update.offsets)
    swap_in = tuple(int(o) for o in update.swap_in_offsets)
    if swap_in and len(swap_in) != swaps:
        raise PlanError("the swap columns (swap_in_offsets included) differ in length")
    return Arena(offsets, int(update.height_bytes), swap_in, int(update.resident_persistent_bytes))


def _pages(update: pool_pb2.PlanUpdate, sizes: tuple[int, ...]) -> Pages:
    page = int(update.page_bytes)
    if page < ALIGNMENT or page & (page - 1):
        raise PlanError(f"page_bytes {page} is not a power of two of at least {ALIGNMENT} bytes")
    for column in ("addresses", "owning"):
        if len(getattr(update, column)) != len(sizes):
            raise PlanError(f"{len(getattr(update, column))} {column} for {len(sizes)} allocations")
    region = int(update.region_bytes)
    if region % page:
        raise PlanError(f"region_bytes {region} is not whole pages of {page} bytes")
    for i, (address, own, size) in enumerate(
        zip(update.addresses, update.owning, sizes, strict=True)
    ):
        end = address + (pages_of(size, page) if own else size)
        if address % (page if own else ALIGNMENT):
            raise PlanError(
                f"addresses[{i}] = {address}: allocation {i}"
                f" {'owns pages' if own else 'shares pages'} but lies off"
                f" {'a page' if own else f'{ALIGNMENT}-byte alignment'}"
            )
        if end > region:
            raise PlanError(
                f"addresses[{i}] = {address}: allocation {i} ends at {end}, past the region's"
                f" {region} bytes"
            )
    for column in ("offsets", "swap_in_offsets", "height_bytes", "resident_persistent_bytes"):
        if getattr(update, column):
            raise PlanError(f"{column} is set: version 3 places blocks by their addresses")
    return Pages(
        page,
        tuple(int(a) for a in update.addresses),
        tuple(bool(o) for o in update.owning),
        region,
        int(update.mapped_peak_bytes),
    )


def _in_range(
    update: pool_pb2.PlanUpdate,
    blocks: str,
    persistent: str | None,
    allocations: int,
    op_columns: tuple[str, ...],
    ops: int | None,
) -> None:
    """PlanError unless every allocation index of column `blocks` (those not flagged by
    column `persistent`: trace ids, which the iteration checks) is under `allocations`, and
    every op index of `op_columns` under `ops` (None: not known here)."""
    flags = getattr(update, persistent) if persistent else ()
    for k, block in enumerate(getattr(update, blocks)):
        if not (flags and flags[k]) and block >= allocations:
            raise PlanError(f"{blocks}[{k}] = {block}: the iteration has {allocations} allocations")
    if ops is None:
        return
    for column in op_columns:
        for k, op in enumerate(getattr(update, column)):
            if op >= ops:
                raise PlanError(f"{column}[{k}] = {op}: the iteration has {ops} ops")


def _swaps(
    update: pool_pb2.PlanUpdate, allocations: int, ops: int | None
) -> tuple[ScheduledSwap, ...]:
    columns: Sequence[Sequence[int]] = (
        update.swap_blocks,
        update.swap_persistent,
        update.swap_out_after,
        update.swap_in_at,
        update.swap_in_before,
    )
    if len({len(c) for c in columns}) != 1:
        raise PlanError(
            "the swap columns differ in length: swap_blocks, swap_persistent, swap_out_after,"
            f" swap_in_at and swap_in_before have {', '.join(str(len(c)) for c in columns)}"
        )
    _in_range(
        update,
        "swap_blocks",
        "swap_persistent",
        allocations,
        ("swap_out_after", "swap_in_at", "swap_in_before"),
        ops,
    )
    swaps = tuple(
        ScheduledSwap(int(block), int(out_after), int(in_before), int(in_at), bool(persistent))
        for block, persistent, out_after, in_at, in_before in zip(*columns, strict=True)
    )
    return swaps


def _recomputes(
    update: pool_pb2.PlanUpdate, allocations: int, ops: int | None
) -> tuple[Recompute, ...]:
    columns = (update.recompute_blocks, update.recompute_drop_after, update.recompute_before)
    if len({len(c) for c in columns}) != 1:
        raise PlanError("the recompute columns differ in length")
    _in_range(
        update,
        "recompute_blocks",
        None,
        allocations,
        ("recompute_drop_after", "recompute_before"),
        ops,
    )
    return tuple(Recompute(int(b), int(d), int(r)) for b, d, r in zip(*columns, strict=True))
