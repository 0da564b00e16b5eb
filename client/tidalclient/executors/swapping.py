"""The swap engine: an adaptor over any executor whose blocks may then wait in the host lease
while ops do not need them.

    Swapping ──blocks: malloc / free──▶ inner executor (recorded there, placed there)
             ──bytes:  vacate / reserve / release──▶ the inner's device bytes, moved by copies

Each block is in one of four places. Copies run on two streams (devices/streams.py), out
(device→host) and in (host→device); the adaptor polls their events, so all of its state stays
on the training thread.

                 evict / scheduled out              out event completes: device bytes released
    DEVICE ──────────────────────────▶ LEAVING ──────────────────────────────────────▶ HOST
      ▲   ◀───────── accessed again before the copy ends: the device bytes were never given up │
      │                                                                                        │
      └──── in event completes: host bytes released ◀── ARRIVING ◀──── access / prefetch ─────┘
                                                       (device bytes reserved when issued)

A block starts on bytes the inner executor placed. Its first swap-out takes them from the inner
(`vacate`); a swap-in comes back on bytes reserved from it (`reserve`). Either way the adaptor
gives them back (`release`) only once no copy uses them, however early the block is freed.

An op announces the blocks it accesses (`begin_op`): they are locked, those on the host are
brought in, and the op waits for their events, so an op never reads a block that is not on the
device. Locked and pinned blocks are never evicted.

Learning (no schedule): SuperNeurons' LRU tensor cache. Whenever placing a block would take the
device bytes held (resident blocks, and blocks still copying out) above `limit`, or it does not
fit in the lease, the least recently used unlocked block goes out, until it fits.

On a GPU the streams are CUDA streams (`streams=`) and the ops' kernels run on a compute
stream (`compute=`) asynchronously to this thread: each copy then waits for the compute work
enqueued before it (a swap-out reads bytes a kernel may still write; a swap-in writes bytes a
freed block's kernel may still read), and an op makes the compute stream wait for its blocks'
swap-ins instead of blocking this thread.

Planned: the daemon's plan (`plans.Plan`) is executed whole. Its `ScheduledSwap` list, against
the iteration's structure (allocation i, op k), swaps a block out right after op `out_after`,
issues its swap-in when op `in_at` begins (with the plan's start ticks: once the event the
simulated copy started after has happened, counting the iteration's mallocs, frees and ops
from 0 as the trace does), and holds op `in_before` until it is back. Its
placement puts every *piece* of device memory at its planned offset in the plan's arena: a
block's allocation slot from its malloc to its first swap-out, then, from each swap-in on, the
piece that swap-in fills (`PlanTable.pieces`: slot len(sizes) + j for swap j).

    arena   [slot of alloc i ]            [piece of swap j]
    block i ███████████████┐  out copy    ┌██████████████    its swap-in lands at the piece
                           └─ the slot is free for its next holder when the copy is *issued*:
                              that holder's work waits for the copy's event on its stream

The bytes of a swapped-out block are reusable in stream order: a block taking a slot that shares
bytes with one whose copy out is still running makes the compute stream wait for that copy's
event (the host, only when there is no compute stream), and a swap-in into such a piece makes
the in stream wait for it. A swap-in whose piece is still held by a live block (a free comes
later in the iteration than the plan's timeline had it) waits for that free, and lands at its
piece then; one that cannot land by the op that needs it comes in on bytes placed online
(`piece_misses`). The switch happens at a `step()` once the arena fits under the limit (least
recently used blocks leave to make room); swapped persistent blocks move into their pieces at
their first scheduled swap-in.

The LRU cache remains the fallback, before a plan and after a miss; its traffic is counted
apart (`on_demand_*_bytes`): in a steady planned iteration it moves nothing. Under a limit, a
plan is executed whole only when it was made for this limit or a lower one (version 2,
`Plan.limit`); an older plan's schedule runs with its swap-ins placed online and its placement
unused (it was made without the swaps).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from tidalcore.planupdate import ScheduledSwap
from tidalcore.units import align_up

from tidalclient.devices.streams import Completion, CopyStream, Stream, Waits
from tidalclient.errors import InvalidBlock, LeaseExceeded
from tidalclient.executors.base import (
    ARRIVING,
    DEVICE,
    HOST,
    LEAVING,
    Block,
    ExecutorStats,
    SwapStats,
    check_size,
    describe,
    size_text,
)
from tidalclient.executors.bestfit import BestFit
from tidalclient.executors.python import PythonExecutor
from tidalclient.plans import OpSchedule, Plan, PlanRejected, PlanTable

if TYPE_CHECKING:
    from tidalclient.timeline import Timeline

log = logging.getLogger("tidalpool")

_Ref = tuple[bool, int]  # a scheduled block: (False, allocation index) or (True, block id)
_T = TypeVar("_T")


@dataclass(slots=True, eq=False)
class _Flight:
    """A copy in flight and what to give back once its event completes: device bytes (how to
    release them) and host bytes (an offset, -1: none)."""

    event: Completion
    entry: _Entry | None  # the block it moves; None once the block was freed or kept
    block_id: int
    size: int  # rounded device bytes
    device: Callable[[], None] | None = None
    host: int = -1
    keepable: bool = True  # False: its device bytes (a plan slot) went to the next holder


@dataclass(slots=True, eq=False)
class _Entry:
    block: Block
    offset: int  # device offset while DEVICE, LEAVING or ARRIVING
    where: str = DEVICE
    host: int = -1  # host offset while LEAVING, HOST or ARRIVING
    locks: int = 0
    pinned: bool = False  # never moves (an ndarray holds its address)
    slot: int = -1  # the plan slot it holds (allocation or piece), -1: none
    flight: _Flight | None = None
    release: Callable[[], None] | None = None  # gives back its device bytes once they are ours

    @property
    def planned(self) -> bool:
        """In a plan's arena: its bytes are the arena's, the LRU leaves it."""
        return self.slot >= 0


class Swapping:
    """Keeps the device bytes `inner` holds at or under `limit` by swapping its blocks.

    `device_address`/`host_address` are where the device and host leases are mapped;
    `host_capacity` the host lease's size; `gbps` throttles both copy streams (None: memmove
    speed). `limit` None means the lease itself. `streams(gbps)` makes the out and in streams
    (default: sim `Stream`s); `compute()`, when given, is the stream the ops' work runs on now,
    which the copies are ordered against (see the module doc).
    """

    def __init__(
        self,
        inner: PythonExecutor,
        *,
        device_address: int,
        host_address: int,
        host_capacity: int,
        limit: int | None = None,
        gbps: float | None = None,
        streams: Callable[[float | None], tuple[CopyStream, CopyStream]] | None = None,
        compute: Callable[[], CopyStream] | None = None,
    ) -> None:
        self.inner = inner
        self._limit = inner.capacity if limit is None else min(limit, inner.capacity)
        self._limited = limit is not None  # a limit of its own: plans' placements go unused
        if self._limit < inner.alignment:
            raise ValueError(f"swap limit of {limit} bytes is below one aligned block")
        self._device_address = device_address
        self._host_address = host_address
        self._host = BestFit(host_capacity, inner.alignment)
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # evictable: least recent first
        self._outs: deque[_Flight] = deque()  # in stream order
        self._ins: deque[_Flight] = deque()
        self._leaving = 0  # device bytes of copies out in flight, released when they complete
        self._schedule: OpSchedule | None = None
        self._pending_schedule: OpSchedule | None = None  # a schedule alone (placement unused)
        self._pending_plan: Plan | None = None  # from the connection's thread
        self._online = False  # install_plan(None): no plan from the next step
        self._staged: tuple[int, OpSchedule | None, int] | None = None  # plan id, schedule, height
        self._table: PlanTable | None = None  # of the plan executed: slots' overlaps
        self._fences: dict[int, Completion] = {}  # slot -> copy out still reading its bytes
        self._pending_ins: dict[int, _Entry] = {}  # swap -> block waiting for its piece
        self._op_index = 0
        self._tick = 0  # events (mallocs, frees, ops) of this iteration so far
        self._iter_ids: list[int] = []  # block ids by allocation index in this iteration
        self.peak_resident_bytes = 0
        self.swapped_out_bytes = 0
        self.swapped_in_bytes = 0
        self.swap_outs = 0
        self.swap_ins = 0
        self.planned_out_bytes = 0  # of swapped_out_bytes: what a schedule asked for
        self.planned_in_bytes = 0
        self.piece_misses = 0  # scheduled swap-ins that could not land at their piece
        self.schedule_skips = 0
        self.plans_deferred = 0  # plans whose placement went unused under the limit
        self._compute = compute
        self._out: CopyStream
        self._in: CopyStream
        if streams is None:
            self._out = Stream("swap-out", gbps)
            self._in = Stream("swap-in", gbps)
        else:
            self._out, self._in = streams(gbps)
        self._waits = Waits(self._out, self._in)

    # -- blocks ------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        """A new block from the inner executor, after making room under the limit for it."""
        nbytes = check_size(nbytes)
        inner = self.inner

        block = self._under_limit(
            nbytes, functools.partial(inner.try_malloc, nbytes), inner.plan_fits(nbytes)
        )
        entry = _Entry(block, block.offset)
        # A block in a slot of a plan's arena holds bytes the arena keeps as a whole: evicting
        # it would give none back, so the LRU leaves it.
        slot = inner.slot(block.id)
        if slot is None:
            self._lru[block.id] = entry
        else:
            entry.slot = slot
            self._fenced(slot)  # its first writer runs after copies out of these bytes
        self._entries[block.id] = entry
        self._iter_ids.append(block.id)
        self._tick += 1
        if self._pending_ins:
            self._retry_ins()
        return block

    def try_malloc(self, nbytes: int) -> Block | None:
        try:
            return self.malloc(nbytes)
        except LeaseExceeded:
            return None

    def free(self, block: Block) -> None:
        entry = self._entries.get(block.id)
        if entry is not None and entry.locks and entry.block == block:
            raise InvalidBlock(f"{describe(block)} is in use by an op")
        self.inner.free(block)  # validates and records; its own bytes, if still its, go back
        e = self._entries.pop(block.id)
        self._lru.pop(block.id, None)
        if e.where == DEVICE:
            if e.release is not None:
                e.release()
        elif e.where == HOST:
            self._host.release(e.host)
        else:  # a copy is in flight: its bytes go back when it completes
            assert e.flight is not None
            if e.where == LEAVING:
                e.flight.host = e.host
            elif e.slot >= 0 and e.release is not None:  # a piece: free now, in stream order
                e.release()
                self._fences[e.slot] = e.flight.event  # its next holder waits for the copy
            else:
                e.flight.device = e.release
            e.flight.entry = None
        self._tick += 1
        if self._pending_ins:
            self._retry_ins()  # a piece this block held may be free now

    def pin(self, block: Block) -> None:
        """Keep the block on the device at its current offset for good."""
        entries = [self._entry(block)]
        self._acquire(entries)
        entries[0].pinned = True
        self._unlock(entries)

    def offset(self, block: Block) -> int:
        """The block's current device offset; InvalidBlock when it is not on the device."""
        e = self._entry(block)
        self._reap()
        if e.where not in (DEVICE, LEAVING):
            raise InvalidBlock(f"{describe(block)} is swapped out: access it inside an op")
        return e.offset

    def where(self, block: Block) -> str:
        """Where the block is: DEVICE, LEAVING, HOST or ARRIVING (completed copies settled)."""
        self._reap()
        return self._entry(block).where

    def swap_out(self, block: Block) -> bool:
        """Start copying the block out now; False when it is locked, pinned or not on the device."""
        e = self._entry(block)
        if e.where != DEVICE or e.locks or e.pinned:
            return False
        self._evict(e)
        return True

    def prefetch(self, block: Block) -> None:
        """Start bringing the block back now, without waiting for it."""
        self._prefetch(self._entry(block))

    # -- ops ----------------------------------------------------------------------------------
    def begin_op(self, blocks: Sequence[Block]) -> list[int]:
        """Lock `blocks` on the device for one op, bringing in and waiting for those that are
        not; their current offsets. Issues the schedule's swap-ins for this op too."""
        entries = [self._entry(b) for b in blocks]
        self._reap()  # bytes of finished copies go back as soon as the training thread looks
        self._tick += 1
        schedule = self._schedule
        if schedule is None:
            self._acquire(entries)
        elif not schedule.slots:  # swap-ins placed here
            k = self._op_index
            ahead = self._scheduled(schedule, schedule.ins_at.get(k, ()))
            needed = self._scheduled(schedule, schedule.needed_before.get(k, ()))
            self._acquire(entries, ahead, needed)
        else:
            k = self._op_index
            for j in schedule.ins_at.get(k, ()):
                e = self._resolve(schedule.refs[j])
                if e is None:
                    self.schedule_skips += 1
                else:
                    self._pending_ins[j] = e  # lands once it is time and its piece is free
            if self._pending_ins:
                self._retry_ins()
            needed = []
            for j in schedule.needed_before.get(k, ()):
                e = self._pending_ins.pop(j, None) or self._resolve(schedule.refs[j])
                if e is None:
                    self.schedule_skips += 1
                    continue
                if e.where in (HOST, LEAVING) and not self._piece_in(e, schedule.slots[j]):
                    self.piece_misses += 1  # it comes in on bytes placed online
                needed.append(e)
            self._acquire(entries, (), needed)
        return [e.offset for e in entries]

    def end_op(self, blocks: Sequence[Block]) -> None:
        """Unlock the op's blocks (now the most recently used) and run the swap-outs after it."""
        self._unlock([e for b in blocks if (e := self._entries.get(b.id)) is not None])
        schedule = self._schedule
        if schedule is not None and (outs := schedule.outs_after.get(self._op_index, ())):
            self._reap()
            for j in outs:
                e = self._resolve(schedule.refs[j])
                if e is not None and e.where == ARRIVING and e.flight is not None:
                    # still landing (moved in at the switch)
                    self._wait(e.flight.event, "its copy in, to send it out")
                    self._reap()
                if e is not None and e.where == DEVICE and not e.locks and not e.pinned:
                    self._evict(e, planned=True)
                else:
                    self.schedule_skips += 1
        self._op_index += 1

    def synchronize(self) -> None:
        """Wait for every copy in flight and release what they free."""
        self._out.synchronize()
        self._in.synchronize()
        self._reap()

    def close(self) -> None:
        """Finish the copies in flight and stop the streams' threads. Idempotent."""
        self._out.close()
        self._in.close()
        self._reap()
        self.inner.close()

    # -- iterations and plans ------------------------------------------------------------------
    def install_plan(self, plan: Plan | None) -> None:
        """Execute this plan from a coming `step()` on (see the module doc); None: no plan
        from the next `step()` on (the LRU cache, as before a plan). Thread-safe against the
        training thread: it only replaces pending values."""
        self._online = plan is None  # before the plan: a step that takes the plan sees this
        self._pending_plan = plan

    def install_schedule(self, swaps: Sequence[ScheduledSwap]) -> None:
        """Swap by this schedule from the next `step()` on (ValueError if malformed)."""
        self._pending_schedule = OpSchedule.build(swaps)

    def step(self) -> int:
        plan, self._pending_plan = self._pending_plan, None
        if self._online:
            self._online = False
            self._schedule = self._pending_schedule = None
            self._staged = None
            self.inner.install_plan(None)
        elif plan is not None:
            self._stage(plan)
        if self._staged is not None:
            self._make_room(self._staged[2], self._staged[1])
        iteration = self.inner.step()
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.inner.used_bytes)
        table = self.inner.plan_table
        if self._staged is not None and table is not None and table.plan_id == self._staged[0]:
            if self._fences:  # slots of the plan before: their copies end before new holders
                self._wait(self._out.record(), "copies out of the plan before")
                self._reap()
                self._fences.clear()
            self._schedule, self._table, self._staged = self._staged[1], table, None
            if self._schedule is not None and self._schedule.slots:
                self._move_into_place(self._schedule)
        elif self._pending_schedule is not None:
            self._schedule, self._pending_schedule = self._pending_schedule, None
        self.piece_misses += len(self._pending_ins)  # never landed in their iteration
        self._pending_ins.clear()
        self._op_index = 0
        self._tick = 0
        self._iter_ids = []
        return iteration

    def _stage(self, plan: Plan) -> None:
        """Hand the plan's placement, with its pieces, to the inner executor; its schedule
        starts once the inner executor has switched to it. Under a limit, a plan not made for
        it runs its schedule alone (see the module doc). A limit over the lease is the lease's
        size, for the plan as for this session (the daemon sends no plan taller than the lease)."""
        made_for = min(plan.limit, self.inner.capacity)
        usable = not self._limited or (plan.version >= 2 and 0 < made_for <= self._limit)
        if usable and (plan.places_swaps or not plan.swaps):
            try:
                table = plan.table.with_pieces(self._pieces(plan), self.inner.alignment)
            except PlanRejected as e:
                log.warning("tidalpool: plan %d: its pieces are unusable: %s", plan.plan_id, e)
            else:
                schedule = (
                    OpSchedule.build(plan.swaps, len(table.sizes), plan.swap_in_ticks)
                    if plan.swaps
                    else None
                )
                self.inner.install_plan(dataclasses.replace(plan, table=table))
                self._staged = (plan.plan_id, schedule, table.height)
                return
        if plan.swaps:
            self._pending_schedule = OpSchedule.build(plan.swaps)
        if self._limited:
            self.plans_deferred += 1
        else:
            self.inner.install_plan(plan)

    def _pieces(self, plan: Plan) -> list[tuple[int, int]]:
        """(size, offset) of each swap's piece; a persistent block's size is its live one."""
        pieces: list[tuple[int, int]] = []
        sizes = plan.table.sizes
        for swap, offset in zip(plan.swaps, plan.swap_in_offsets, strict=True):
            if swap.persistent:
                e = self._entries.get(swap.block)
                if e is None:
                    raise PlanRejected(f"persistent block {swap.block} is not live")
                size = int(e.block.size)
            elif swap.block < len(sizes):
                size = sizes[swap.block]
            else:
                raise PlanRejected(f"{swap} names allocation {swap.block} of {len(sizes)}")
            pieces.append((size, offset))
        return pieces

    def _make_room(self, height: int, schedule: OpSchedule | None) -> None:
        """Before the switch: blocks leave until the arena fits under the limit, and their
        copies complete (on demand, and once). First the persistent blocks the plan swaps
        (they go to their pieces at the switch), then the least recently used; every one that
        can when no range of the lease is long enough for the arena, whatever the limit (at
        the lease's size too: the arena needs one range)."""
        inner = self.inner

        def over() -> int:  # the arena held now goes at the switch
            return inner.used_bytes - inner.arena_bytes + height - self._limit

        moving = [] if schedule is None else self._swapped_persistent(schedule)
        while over() > 0:
            first = next((e for e in moving if e.where == DEVICE and e.slot < 0), None)
            if over() > self._leaving and first is not None and not (first.locks or first.pinned):
                self._evict(first)
            elif over() > self._leaving and self._lru:
                self._evict(next(iter(self._lru.values())))
            elif self._outs or self._ins:  # bytes leaving come back; blocks landing can leave
                self._wait((self._outs or self._ins)[0].event, "copies, to switch plans")
                self._reap()
            else:
                break  # what stays is locked or pinned: the switch waits for a later step
        if inner.arena_bytes == 0 and inner.largest_free < align_up(height, inner.alignment):
            # Room enough, but no range of the lease for the arena: what is evictable leaves.
            self._wait(self._in.record(), "copies in, to make a range for the plan")
            self._reap()
            for e in [*moving, *self._lru.values()]:
                if e.where == DEVICE and e.slot < 0 and not (e.locks or e.pinned):
                    self._evict(e)
            self._wait(self._out.record(), "copies out, to make a range for the plan")
            self._reap()

    def _swapped_persistent(self, schedule: OpSchedule) -> list[_Entry]:
        """The live persistent blocks a schedule swaps, once each."""
        ids = dict.fromkeys(index for persistent, index in schedule.refs if persistent)
        return [e for i in ids if (e := self._entries.get(i)) is not None]

    def _move_into_place(self, schedule: OpSchedule) -> None:
        """At the switch: each persistent block the plan swaps goes where the plan has it as
        an iteration begins, on demand and once: to the host if its swap crosses the boundary,
        else into the piece of its last swap-in (the piece that holds it across the boundary).
        """
        last: dict[int, int] = {}  # block id -> its swap whose piece it starts in, -1: away
        for j, (persistent, index) in enumerate(schedule.refs):
            if not persistent or last.get(index) == -1:
                continue
            crosses = schedule.in_before[j] <= schedule.out_after[j]
            if crosses:
                last[index] = -1
            elif index not in last or schedule.in_before[j] > schedule.in_before[last[index]]:
                last[index] = j
        for index, j in last.items():
            e = self._entries.get(index)
            if e is None or e.locks or e.pinned or e.slot >= 0:
                continue
            if e.where == DEVICE:
                self._evict(e)
            if j >= 0:  # into its piece: once its copy out has ended
                if e.where == LEAVING:
                    assert e.flight is not None
                    self._wait(e.flight.event, "its copy out, to bring it into its piece")
                    self._reap()
                if not self._piece_in(e, schedule.slots[j], planned=False):
                    self.piece_misses += 1

    # -- views --------------------------------------------------------------------------------
    @property
    def session(self) -> int:
        return self.inner.session

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def alignment(self) -> int:
        return self.inner.alignment

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    @property
    def largest_free(self) -> int:
        return self.inner.largest_free

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def host_used_bytes(self) -> int:
        """Bytes of the host lease holding swapped-out blocks."""
        return self._host.used_bytes

    def stats(self) -> ExecutorStats:
        return dataclasses.replace(self.inner.stats(), swap=self.swap_stats())

    def swap_stats(self) -> SwapStats:
        return SwapStats(
            limit=self._limit,
            resident_bytes=self.inner.used_bytes,
            peak_resident_bytes=self.peak_resident_bytes,
            swapped_out_bytes=self.swapped_out_bytes,
            swapped_in_bytes=self.swapped_in_bytes,
            swap_outs=self.swap_outs,
            swap_ins=self.swap_ins,
            stall_ns=self.stall_ns,
            scheduled_swaps=self._schedule.swaps if self._schedule is not None else 0,
            schedule_skips=self.schedule_skips,
            host_used_bytes=self._host.used_bytes,
            planned_out_bytes=self.planned_out_bytes,
            planned_in_bytes=self.planned_in_bytes,
            on_demand_out_bytes=self.swapped_out_bytes - self.planned_out_bytes,
            on_demand_in_bytes=self.swapped_in_bytes - self.planned_in_bytes,
            piece_misses=self.piece_misses,
        )

    # -- the engine -----------------------------------------------------------------------------
    def _entry(self, block: Block) -> _Entry:
        e = self._entries.get(block.id)
        if e is None or e.block != block:
            raise InvalidBlock(f"{describe(block)} is not live in this session")
        return e

    def _resolve(self, ref: _Ref) -> _Entry | None:
        persistent, index = ref
        if persistent:
            return self._entries.get(index)
        ids = self._iter_ids
        return self._entries.get(ids[index]) if index < len(ids) else None

    def _scheduled(self, schedule: OpSchedule, swaps: Sequence[int]) -> list[_Entry]:
        found = [e for j in swaps if (e := self._resolve(schedule.refs[j])) is not None]
        self.schedule_skips += len(swaps) - len(found)
        return found

    def _acquire(
        self, entries: list[_Entry], ahead: Sequence[_Entry] = (), needed: Sequence[_Entry] = ()
    ) -> None:
        """Lock `entries` and make them resident; meanwhile issue the swap-ins of `ahead` and
        `needed`, and wait for `needed` too. On failure nothing stays locked."""
        for e in entries:  # lock first: bringing in one of them must not evict another
            if e.where == LEAVING:
                self._settle(e)
            if not e.locks:
                self._lru.pop(e.block.id, None)
            e.locks += 1
        try:
            for e in (*needed, *ahead):  # first: what the schedule brings in is not on demand
                self._scheduled_in(e)
            for e in entries:
                if e.where == HOST:
                    self._bring_in(e)
            compute = None if self._compute is None else self._compute()
            for e in (*entries, *needed):
                if e.where == ARRIVING:
                    assert e.flight is not None
                    if compute is not None:  # the op's kernels start once the copy is done
                        compute.wait_event(e.flight.event)
                    else:
                        self._wait(e.flight.event, "copy in, for an op")
                        self._reap()
        except BaseException:
            self._unlock(entries)
            raise

    def _prefetch(self, e: _Entry, planned: bool = False) -> None:
        e.locks += 1  # making room for it must not choose it
        try:
            self._bring_in(e, planned)
        finally:
            self._unlock([e])

    def _scheduled_in(self, e: _Entry) -> None:
        """A scheduled swap-in, best effort: with no room for it now (the op's own blocks and
        pinned ones fill the limit) it is skipped, and the block comes in when an op needs it."""
        try:
            self._prefetch(e, planned=True)
        except LeaseExceeded:
            self.schedule_skips += 1

    def _unlock(self, entries: list[_Entry]) -> None:
        lru = self._lru
        for e in entries:
            e.locks -= 1
            if not e.locks and e.where == DEVICE and not (e.pinned or e.planned):
                lru[e.block.id] = e  # re-inserted: now the most recently used

    def _under_limit(
        self, nbytes: int, take: Callable[[], _T | None], in_arena: bool = False
    ) -> _T:
        """What `take()` gives (a block, or raw bytes, of `nbytes`) once the device bytes held
        stay under the limit with it: reaps finished copies, evicts least recently used blocks
        and waits for their copies as needed. With the lease as the limit, whatever the inner
        executor can place fits; so does a plan's slot (`in_arena`: bytes the arena holds)."""
        inner, limit = self.inner, self._limit
        size = align_up(nbytes, inner.alignment)
        if size > limit:
            raise LeaseExceeded(f"{size_text(size)} exceed the swap limit of {size_text(limit)}")
        lease_is_limit = limit >= inner.capacity
        while True:
            self._reap()
            if lease_is_limit or in_arena or inner.used_bytes + size <= limit:
                got = take()
                if got is not None:
                    self.peak_resident_bytes = max(self.peak_resident_bytes, inner.used_bytes)
                    return got
            if self._lru and (not self._outs or inner.used_bytes - self._leaving + size > limit):
                self._evict(next(iter(self._lru.values())))
            elif self._outs:  # bytes on their way out come back when their copies complete
                self._wait(self._outs[0].event, "copy out, for room")
            elif self._ins:  # blocks landing become evictable
                self._wait(self._ins[0].event, "copy in, for room")
            else:
                raise LeaseExceeded(
                    f"{size_text(size)} do not fit under the swap limit of {size_text(limit)}"
                    " even with every unlocked block swapped out:"
                    f" {size_text(inner.used_bytes)} held by locked or pinned blocks,"
                    f" largest free range {size_text(inner.largest_free)}"
                )

    def _host_room(self, size: int) -> int:
        while (offset := self._host.allocate(size)) is None:
            flights = self._ins or self._outs  # both may hold host bytes until they complete
            if not flights:
                lease, used = size_text(self._host.capacity), size_text(self._host.used_bytes)
                raise LeaseExceeded(
                    f"cannot swap out {size_text(size)}: the host lease of {lease}"
                    f" is full ({used} swapped out)"
                )
            self._wait(flights[0].event, "copies, for host room")
            self._reap()
        return offset

    def _evict(self, e: _Entry, planned: bool = False) -> None:
        """Start copying a resident, unlocked block out. Its device bytes go when the copy
        ends; a plan slot's go now, to a next holder that waits for the copy (module doc).
        `planned`: a schedule's swap-out (else on demand)."""
        block = e.block
        size = align_up(block.size, self.inner.alignment)
        host = self._host_room(size)
        self._lru.pop(block.id, None)
        if self._compute is not None:  # after the kernels that write the block
            self._out.wait_event(self._compute().record())
        self._out.copy(self._host_address + host, self._device_address + e.offset, block.size)
        event = self._out.record()
        release = e.release if e.release is not None else self.inner.vacate(block)
        if e.slot >= 0:
            release()
            self._fences[e.slot] = event
            flight = _Flight(event, e, block.id, size, keepable=False)
            e.slot = -1
        else:
            flight = _Flight(event, e, block.id, size, device=release)
            self._leaving += size
        e.where, e.host, e.flight, e.release = LEAVING, host, flight, None
        self._outs.append(flight)
        self.swapped_out_bytes += block.size
        self.swap_outs += 1
        if planned:
            self.planned_out_bytes += block.size
        if not flight.keepable and self._pending_ins:
            self._retry_ins()  # a piece waiting for this slot's bytes can land now

    def _settle(self, e: _Entry) -> None:
        """A block wanted while its copy out runs: it keeps its device bytes (still intact),
        unless they were a plan slot, already someone else's; then it waits for the copy."""
        flight = e.flight
        assert flight is not None
        if not flight.keepable:
            self._wait(flight.event, "its copy out, to bring it back")
            self._reap()
            return
        e.release, flight.device, flight.host, flight.entry = flight.device, None, e.host, None
        self._leaving -= flight.size
        e.where, e.host, e.flight = DEVICE, -1, None

    def _bring_in(self, e: _Entry, planned: bool = False) -> None:
        """Start bringing a block back on bytes placed online: DEVICE or ARRIVING stay,
        LEAVING is settled, HOST copies. `planned`: a schedule's swap-in (else on demand)."""
        if e.where == LEAVING:
            self._settle(e)
        if e.where != HOST:
            return
        block = e.block
        inner = self.inner
        offset = self._under_limit(block.size, functools.partial(inner.reserve, block.size))
        if self._compute is not None:  # after the kernels of the bytes' previous holder
            self._in.wait_event(self._compute().record())
        self._in.copy(self._device_address + offset, self._host_address + e.host, block.size)
        size = align_up(block.size, inner.alignment)
        flight = _Flight(self._in.record(), e, block.id, size, host=e.host)
        e.where, e.offset, e.host, e.flight = ARRIVING, offset, -1, flight
        e.release = functools.partial(inner.release, offset)
        self._ins.append(flight)
        self.swapped_in_bytes += block.size
        self.swap_ins += 1
        if planned:
            self.planned_in_bytes += block.size

    def _piece_in(self, e: _Entry, slot: int, planned: bool = True) -> bool:
        """A swap-in into a planned piece (`planned`: the schedule's); False while the
        piece's bytes are held by a live block (nothing issued then)."""
        if e.where == LEAVING:
            self._settle(e)
        if e.where != HOST:
            return True
        block, inner = e.block, self.inner
        offset = inner.reserve_piece(slot, block.id)
        if offset is None:
            return False
        if self._compute is not None:  # after the kernels of the bytes' previous holder
            self._in.wait_event(self._compute().record())
        self._fenced(slot, self._in)
        self._in.copy(self._device_address + offset, self._host_address + e.host, block.size)
        size = align_up(block.size, inner.alignment)
        flight = _Flight(self._in.record(), e, block.id, size, host=e.host)
        e.where, e.offset, e.host, e.flight = ARRIVING, offset, -1, flight
        e.slot = slot
        e.release = functools.partial(inner.release_piece, block.id)
        self._ins.append(flight)
        self.swapped_in_bytes += block.size
        if planned:
            self.planned_in_bytes += block.size
        self.swap_ins += 1
        return True

    def _retry_ins(self) -> None:
        """Land the swap-ins waiting for their pieces whose bytes are free now."""
        schedule = self._schedule
        for j, e in list(self._pending_ins.items()):
            if self._entries.get(e.block.id) is not e or schedule is None:
                del self._pending_ins[j]  # freed meanwhile
            elif schedule.starts and schedule.starts[j] >= self._tick:
                continue  # the event its copy starts after has not happened yet
            elif self._piece_in(e, schedule.slots[j]):
                del self._pending_ins[j]

    def _fenced(self, slot: int, stream: CopyStream | None = None) -> None:
        """Order the next use of a slot's bytes after the copies out still reading them: on
        `stream`, else on the compute stream, else (no compute stream) on this thread."""
        fences, table = self._fences, self._table
        if not fences or table is None:
            return
        for k in (slot, *table.overlaps[slot]):
            event = fences.get(k)
            if event is None:
                continue
            if event.query():
                del fences[k]
            elif stream is not None:
                stream.wait_event(event)
            elif self._compute is not None:
                self._compute().wait_event(event)
            else:
                self._wait(event, "copy, for an op")

    def _wait(self, event: Completion, why: str) -> None:
        """Block until `event` has completed: a stall, counted in `stall_ns` and, with a
        timeline, a span on its host track named `why`."""
        self._waits.wait(event, why)

    @property
    def stall_ns(self) -> int:
        """Time ops and mallocs blocked for copies."""
        return self._waits.stall_ns

    @property
    def timeline(self) -> Timeline | None:
        """Where the copies and the waits go as spans (`tidalclient.timeline`; None: nowhere)."""
        return self._waits.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self._waits.timeline = timeline

    def _reap(self) -> None:
        """Settle every copy whose event has completed (each stream completes in order)."""
        outs = self._outs
        while outs and outs[0].event.query():
            f = outs.popleft()
            f.event.wait()  # raises if the copy failed
            if f.device is not None:
                f.device()
                self._leaving -= f.size
            if f.host >= 0:
                self._host.release(f.host)
            if f.entry is not None:
                f.entry.where, f.entry.flight = HOST, None
        ins = self._ins
        while ins and ins[0].event.query():
            f = ins.popleft()
            f.event.wait()
            if f.host >= 0:
                self._host.release(f.host)
            if f.device is not None:  # freed while arriving
                f.device()
            e = f.entry
            if e is not None:
                e.where, e.flight = DEVICE, None
                if not e.locks and not (e.pinned or e.planned):
                    self._lru[e.block.id] = e
