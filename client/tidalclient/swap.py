"""The swap engine: an executor whose blocks may wait in the host lease while ops do not need them.

Each block is in one of four places. Copies run on two streams (devices/streams.py), out
(device→host) and in (host→device); the executor polls their events, so all of its state stays
on the training thread.

                 evict / scheduled out              out event completes: device bytes released
    DEVICE ──────────────────────────▶ LEAVING ──────────────────────────────────────▶ HOST
      ▲   ◀───────── accessed again before the copy ends: the device bytes were never given up │
      │                                                                                        │
      └──── in event completes: host bytes released ◀── ARRIVING ◀──── access / prefetch ─────┘
                                                       (device bytes placed when issued)

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

Planned: a `ScheduledSwap` list against the iteration's structure (allocation i, op k) swaps a
block out right after op `out_after`, issues its swap-in when op `in_at` begins, and holds op
`in_before` until it is back. The LRU cache still guards the limit where the schedule falls short.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidalcore.units import ALIGNMENT, align_up

from tidalclient.devices.streams import Completion, CopyStream, Stream
from tidalclient.errors import InvalidBlock, LeaseExceeded
from tidalclient.executor import BestFit, Block, Executor, Recorder, _describe, _size

DEVICE, LEAVING, HOST, ARRIVING = "device", "leaving", "host", "arriving"

_Ref = tuple[bool, int]  # a scheduled block: (False, allocation index) or (True, block id)


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


@dataclass(slots=True, eq=False)
class _Flight:
    """A copy in flight and the bytes to give back once its event completes (-1: none)."""

    event: Completion
    entry: _Entry | None  # the block it moves; None once the block was freed or kept
    block_id: int
    size: int  # rounded device bytes
    device: int = -1
    host: int = -1


@dataclass(slots=True, eq=False)
class _Entry:
    block: Block
    offset: int  # device offset while DEVICE, LEAVING or ARRIVING
    where: str = DEVICE
    host: int = -1  # host offset while LEAVING, HOST or ARRIVING
    locks: int = 0
    pinned: bool = False  # never moves (an ndarray holds its address)
    planned: bool = False  # in a plan's arena: its bytes are the arena's, the LRU leaves it
    flight: _Flight | None = None


@dataclass(frozen=True, slots=True)
class SwapStats:
    limit: int
    resident_bytes: int  # device bytes held: resident blocks and blocks copying out, rounded
    peak_resident_bytes: int
    swapped_out_bytes: int
    swapped_in_bytes: int
    swap_outs: int
    swap_ins: int
    stall_ns: int  # time ops and mallocs waited for copies
    scheduled_swaps: int  # swaps in the schedule in use (0: none, LRU only)
    schedule_skips: int  # scheduled swaps not applied (block gone, locked or pinned, or no room)


class SwappingExecutor(Executor):
    """An `Executor` that keeps the device bytes it holds at or under `limit` by swapping.

    `device_address`/`host_address` are where the device and host leases are mapped;
    `host_capacity` the host lease's size; `gbps` throttles both copy streams (None: memmove
    speed). `limit` None means the lease itself. `streams(gbps)` makes the out and in streams
    (default: sim `Stream`s); `compute()`, when given, is the stream the ops' work runs on now,
    which the copies are ordered against (see the module doc).
    """

    __slots__ = (
        "_compute",
        "_device_address",
        "_entries",
        "_host",
        "_host_address",
        "_in",
        "_ins",
        "_iter_ids",
        "_iterations",
        "_leaving",
        "_limit",
        "_lru",
        "_op_index",
        "_out",
        "_outs",
        "_pending_schedule",
        "_plans_allowed",
        "_schedule",
        "peak_resident_bytes",
        "plans_deferred",
        "schedule_skips",
        "stall_ns",
        "swap_ins",
        "swap_outs",
        "swapped_in_bytes",
        "swapped_out_bytes",
    )

    def __init__(
        self,
        capacity: int,
        *,
        device_address: int,
        host_address: int,
        host_capacity: int,
        limit: int | None = None,
        gbps: float | None = None,
        alignment: int = ALIGNMENT,
        record: Recorder | None = None,
        streams: Callable[[float | None], tuple[CopyStream, CopyStream]] | None = None,
        compute: Callable[[], CopyStream] | None = None,
    ) -> None:
        super().__init__(capacity, alignment, record)
        self._limit = self._fit.capacity if limit is None else min(limit, self._fit.capacity)
        # Under a limit, a placement plan made without the swaps is never used: its arena's
        # blocks are not evictable, so how much room the swaps leave is no longer in hand.
        self._plans_allowed = limit is None
        if self._limit < alignment:
            raise ValueError(f"swap limit of {limit} bytes is below one aligned block")
        self._device_address = device_address
        self._host_address = host_address
        self._host = BestFit(host_capacity, alignment)
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # evictable: least recent first
        self._outs: deque[_Flight] = deque()  # in stream order
        self._ins: deque[_Flight] = deque()
        self._leaving = 0  # device bytes of copies out in flight, released when they complete
        self._schedule: _Schedule | None = None
        self._pending_schedule: _Schedule | None = None
        self._iterations = 0
        self._op_index = 0
        self._iter_ids: list[int] = []  # block ids by allocation index in this iteration
        self.peak_resident_bytes = 0
        self.swapped_out_bytes = 0
        self.swapped_in_bytes = 0
        self.swap_outs = 0
        self.swap_ins = 0
        self.stall_ns = 0
        self.schedule_skips = 0
        self.plans_deferred = 0
        self._compute = compute
        self._out: CopyStream
        self._in: CopyStream
        if streams is None:
            self._out = Stream("swap-out", gbps)
            self._in = Stream("swap-in", gbps)
        else:
            self._out, self._in = streams(gbps)

    # -- allocation ------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        block = super().malloc(nbytes)  # `_place` makes room
        entry = _Entry(block, block.offset)
        arena = self._arena
        if arena is not None and block.id in arena.slot_of:
            entry.planned = True
        else:
            self._lru[block.id] = entry
        self._entries[block.id] = entry
        self._iter_ids.append(block.id)
        return block

    def _place(self, nbytes: int) -> int:
        return self._room(nbytes)

    def free(self, block: Block) -> None:
        entry = self._entries.get(block.id)
        if entry is not None and entry.locks and entry.block == block:
            raise InvalidBlock(f"{_describe(block)} is in use by an op")
        super().free(block)  # validates, then `_unplace`

    def _unplace(self, block_id: int, offset: int) -> None:
        e = self._entries.pop(block_id)
        self._lru.pop(block_id, None)
        if e.where == DEVICE:
            super()._unplace(block_id, e.offset)
        elif e.where == HOST:
            self._host.release(e.host)
        else:  # a copy is in flight: its bytes go back when it completes
            assert e.flight is not None
            if e.where == LEAVING:
                e.flight.host = e.host
            else:
                e.flight.device = e.offset
            e.flight.entry = None

    def pin(self, block: Block) -> None:
        """Keep the block on the device at its current offset for good."""
        entries = [self._entry(block)]
        self._acquire(entries)
        entries[0].pinned = True
        self._unlock(entries)

    # -- ops ----------------------------------------------------------------------------------
    def begin_op(self, blocks: Sequence[Block]) -> list[int]:
        """Lock `blocks` on the device for one op, bringing in and waiting for those that are
        not; their current offsets. Issues the schedule's swap-ins for this op too."""
        entries = [self._entry(b) for b in blocks]
        self._reap()  # bytes of finished copies go back as soon as the training thread looks
        schedule = self._schedule
        if schedule is None:
            self._acquire(entries)
        else:
            k = self._op_index
            ahead = self._scheduled(schedule.ins_at.get(k, ()))
            self._acquire(entries, ahead, self._scheduled(schedule.needed_before.get(k, ())))
        return [e.offset for e in entries]

    def end_op(self, blocks: Sequence[Block]) -> None:
        """Unlock the op's blocks (now the most recently used) and run the swap-outs after it."""
        self._unlock([e for b in blocks if (e := self._entries.get(b.id)) is not None])
        schedule = self._schedule
        if schedule is not None:
            for ref in schedule.outs_after.get(self._op_index, ()):
                e = self._resolve(ref)
                if e is not None and e.where == DEVICE and not e.locks and not e.pinned:
                    self._evict(e)
                else:
                    self.schedule_skips += 1
        self._op_index += 1

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

    def where(self, block: Block) -> str:
        """Where the block is: DEVICE, LEAVING, HOST or ARRIVING (completed copies settled)."""
        self._reap()
        return self._entry(block).where

    def offset(self, block: Block) -> int:
        """The block's current device offset; InvalidBlock when it is not on the device."""
        e = self._entry(block)
        self._reap()
        if e.where not in (DEVICE, LEAVING):
            raise InvalidBlock(f"{_describe(block)} is swapped out: access it inside an op")
        return e.offset

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

    # -- planned mode ---------------------------------------------------------------------------
    def install_schedule(self, swaps: Sequence[ScheduledSwap]) -> None:
        """Swap by this schedule from the next `begin_iteration()` on (ValueError if malformed).
        Thread-safe against the training thread: it only replaces the pending schedule."""
        self._pending_schedule = _Schedule.build(swaps)

    def begin_iteration(self) -> None:
        pending = self._pending
        if pending is not None and (
            not self._plans_allowed or self._fit.used_bytes + pending.height > self._limit
        ):
            self._pending = None  # keep learning: the schedule and the LRU cache keep the limit
            self.plans_deferred += 1
            try:
                super().begin_iteration()
            finally:
                self._pending = pending
        else:
            super().begin_iteration()
        self.peak_resident_bytes = max(self.peak_resident_bytes, self._fit.used_bytes)
        if self._pending_schedule is not None:
            self._schedule, self._pending_schedule = self._pending_schedule, None
        self._iterations += 1
        self._op_index = 0
        self._iter_ids = []

    # -- views --------------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        return self._limit

    @property
    def host_used_bytes(self) -> int:
        """Bytes of the host lease holding swapped-out blocks."""
        return self._host.used_bytes

    def swap_stats(self) -> SwapStats:
        return SwapStats(
            limit=self._limit,
            resident_bytes=self._fit.used_bytes,
            peak_resident_bytes=self.peak_resident_bytes,
            swapped_out_bytes=self.swapped_out_bytes,
            swapped_in_bytes=self.swapped_in_bytes,
            swap_outs=self.swap_outs,
            swap_ins=self.swap_ins,
            stall_ns=self.stall_ns,
            scheduled_swaps=self._schedule.swaps if self._schedule is not None else 0,
            schedule_skips=self.schedule_skips,
        )

    # -- the engine -----------------------------------------------------------------------------
    def _entry(self, block: Block) -> _Entry:
        e = self._entries.get(block.id)
        if e is None or e.block != block:
            raise InvalidBlock(f"{_describe(block)} is not live in this session")
        return e

    def _resolve(self, ref: _Ref) -> _Entry | None:
        persistent, index = ref
        if persistent:
            return self._entries.get(index)
        ids = self._iter_ids
        return self._entries.get(ids[index]) if index < len(ids) else None

    def _scheduled(self, refs: Sequence[_Ref]) -> list[_Entry]:
        found = [e for ref in refs if (e := self._resolve(ref)) is not None]
        self.schedule_skips += len(refs) - len(found)
        return found

    def _acquire(
        self, entries: list[_Entry], ahead: Sequence[_Entry] = (), needed: Sequence[_Entry] = ()
    ) -> None:
        """Lock `entries` and make them resident; meanwhile issue the swap-ins of `ahead` and
        `needed`, and wait for `needed` too. On failure nothing stays locked."""
        for e in entries:  # lock first: bringing in one of them must not evict another
            if e.where == LEAVING:
                self._keep(e)
            if not e.locks:
                self._lru.pop(e.block.id, None)
            e.locks += 1
        try:
            for e in entries:
                if e.where == HOST:
                    self._bring_in(e)
            for e in (*needed, *ahead):
                self._scheduled_in(e)
            compute = None if self._compute is None else self._compute()
            for e in (*entries, *needed):
                if e.where == ARRIVING:
                    assert e.flight is not None
                    if compute is not None:  # the op's kernels start once the copy is done
                        compute.wait_event(e.flight.event)
                    else:
                        self._wait(e.flight.event)
                        self._reap()
        except BaseException:
            self._unlock(entries)
            raise

    def _prefetch(self, e: _Entry) -> None:
        e.locks += 1  # making room for it must not choose it
        try:
            self._bring_in(e)
        finally:
            self._unlock([e])

    def _scheduled_in(self, e: _Entry) -> None:
        """A scheduled swap-in, best effort: with no room for it now (the op's own blocks and
        pinned ones fill the limit) it is skipped, and the block comes in when an op needs it."""
        try:
            self._prefetch(e)
        except LeaseExceeded:
            self.schedule_skips += 1

    def _unlock(self, entries: list[_Entry]) -> None:
        lru = self._lru
        for e in entries:
            e.locks -= 1
            if not e.locks and e.where == DEVICE and not (e.pinned or e.planned):
                lru[e.block.id] = e  # re-inserted: now the most recently used

    def _room(self, nbytes: int) -> int:
        """A device offset for `nbytes` that keeps the bytes held under the limit: reaps finished
        copies, evicts least recently used blocks and waits for their copies as needed."""
        fit, limit = self._fit, self._limit
        size = align_up(nbytes, fit.alignment)
        if size > limit:
            raise LeaseExceeded(f"{_size(size)} exceed the swap limit of {_size(limit)}")
        while True:
            self._reap()
            if fit.used_bytes + size <= limit:
                offset = fit.allocate(size)
                if offset is not None:
                    self.peak_resident_bytes = max(self.peak_resident_bytes, fit.used_bytes)
                    self._high_water = max(self._high_water, offset + nbytes)
                    return offset
            if self._lru and (not self._outs or fit.used_bytes - self._leaving + size > limit):
                self._evict(next(iter(self._lru.values())))
            elif self._outs:  # bytes on their way out come back when their copies complete
                self._wait(self._outs[0].event)
            elif self._ins:  # blocks landing become evictable
                self._wait(self._ins[0].event)
            else:
                raise LeaseExceeded(
                    f"{_size(size)} do not fit under the swap limit of {_size(limit)} even with"
                    f" every unlocked block swapped out: {_size(fit.used_bytes)} held by locked"
                    f" or pinned blocks, largest free range {_size(fit.largest_free)}"
                )

    def _host_room(self, size: int) -> int:
        while (offset := self._host.allocate(size)) is None:
            flights = self._ins or self._outs  # both may hold host bytes until they complete
            if not flights:
                raise LeaseExceeded(
                    f"cannot swap out {_size(size)}: the host lease of {_size(self._host.capacity)}"
                    f" is full ({_size(self._host.used_bytes)} swapped out)"
                )
            self._wait(flights[0].event)
            self._reap()
        return offset

    def _evict(self, e: _Entry) -> None:
        """Start copying a resident, unlocked block out; its device bytes go when the copy ends."""
        block = e.block
        size = align_up(block.size, self._fit.alignment)
        host = self._host_room(size)
        self._lru.pop(block.id, None)
        if self._compute is not None:  # after the kernels that write the block
            self._out.wait_event(self._compute().record())
        self._out.copy(self._host_address + host, self._device_address + e.offset, block.size)
        flight = _Flight(self._out.record(), e, block.id, size, device=e.offset)
        e.where, e.host, e.flight, e.planned = LEAVING, host, flight, False  # returns online
        self._outs.append(flight)
        self._leaving += size
        self.swapped_out_bytes += block.size
        self.swap_outs += 1

    def _keep(self, e: _Entry) -> None:
        """A block wanted while its copy out runs keeps its device bytes (still intact)."""
        flight = e.flight
        assert flight is not None
        flight.device, flight.host, flight.entry = -1, e.host, None
        self._leaving -= flight.size
        e.where, e.host, e.flight = DEVICE, -1, None

    def _bring_in(self, e: _Entry) -> None:
        """Start bringing a block back: DEVICE or ARRIVING stay, LEAVING is kept, HOST copies."""
        if e.where == LEAVING:
            self._keep(e)
        if e.where != HOST:
            return
        block = e.block
        offset = self._room(block.size)
        if self._compute is not None:  # after the kernels of the bytes' previous holder
            self._in.wait_event(self._compute().record())
        self._in.copy(self._device_address + offset, self._host_address + e.host, block.size)
        size = align_up(block.size, self._fit.alignment)
        flight = _Flight(self._in.record(), e, block.id, size, host=e.host)
        e.where, e.offset, e.host, e.flight = ARRIVING, offset, -1, flight
        self._ins.append(flight)
        self.swapped_in_bytes += block.size
        self.swap_ins += 1

    def _wait(self, event: Completion) -> None:
        if not event.query():
            start = time.perf_counter_ns()
            event.wait()
            self.stall_ns += time.perf_counter_ns() - start

    def _reap(self) -> None:
        """Settle every copy whose event has completed (each stream completes in order)."""
        outs = self._outs
        while outs and outs[0].event.query():
            f = outs.popleft()
            f.event.wait()  # raises if the copy failed
            if f.device >= 0:
                super()._unplace(f.block_id, f.device)
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
            if f.device >= 0:  # freed while arriving
                self._fit.release(f.device)
            e = f.entry
            if e is not None:
                e.where, e.flight = DEVICE, None
                if not e.locks and not e.pinned:
                    self._lru[e.block.id] = e


@dataclass(frozen=True, slots=True)
class _Schedule:
    """A swap schedule by op index: swap-outs after op k, swap-ins issued at op k, and the
    blocks op k waits for."""

    outs_after: dict[int, tuple[_Ref, ...]]
    ins_at: dict[int, tuple[_Ref, ...]]
    needed_before: dict[int, tuple[_Ref, ...]]
    swaps: int

    @classmethod
    def build(cls, swaps: Sequence[ScheduledSwap]) -> _Schedule:
        by_op: tuple[dict[int, list[_Ref]], ...] = ({}, {}, {})
        for s in swaps:
            s.check()
            ref = (s.persistent, s.block)
            for table, k in zip(by_op, (s.out_after, s.issue_at(), s.in_before), strict=True):
                table.setdefault(k, []).append(ref)
        outs, ins, needed = ({k: tuple(v) for k, v in t.items()} for t in by_op)
        return cls(outs, ins, needed, len(swaps))
