"""Paged: the executor of a session under virtual residency. Every block keeps one address for
life in a reserved virtual range; under the limit, pages of the lease move beneath the blocks.

    the range (addresses, reserved once)
    │ page-owning blocks placed  │ packed blocks placed     │ the plan's region: its allocations │
    │ online (learning, misses)  │ online                   │ at the addresses the plan gave     │
    0                       quarter                      half                                length
                 │ pages mapped beneath resident blocks (Residency) │
    the lease    │ p0 │ p1 │ p2 │ ...                                │  at most `limit` bytes mapped

A block of a page or more whose rounding to whole pages wastes little (`tidalcore.pages.
owns_pages`) owns whole pages and is the only kind that moves; smaller ones are packed and share
pages. `limit` counts mapped pages: copies out keep theirs until their event completes.

Learning (no plan): blocks are placed online in the first half of the range, and whenever
mapping a block's pages would take the mapped bytes over the limit, the copies in flight are
waited for, oldest first, then the least recently used page-owning block that no op holds
leaves (SuperNeurons' LRU tensor cache), until it fits. Each `step()` tells the daemon where
every live block lies (the trace's step mark): a paged plan keeps the persistent ones there, and
a later plan's region lies past the live blocks of the one before.

Planned (a version-3 plan, `tidalcore.planupdate.Pages`): from the `step()` after `install_plan`,
allocation i of each iteration lies at the region's start plus the plan's address for it, and the
schedule runs as the daemon simulated it: block out once op `out_after` ends (its pages go once the
copy is done, `Residency.poll`), its swap-in issued when op `in_at` begins and the event the
simulated copy started after has happened (counting the iteration's mallocs, frees and ops from 0,
as the trace does), as soon as its pages fit under the limit, and op `in_before` waits for it. What
the plan did not foresee (an allocation of another size, a slot still held) is placed online, a
miss, and the LRU cache makes room when the schedule has not; its traffic is counted apart.

Ops: `begin_op` brings in the op's blocks that are away and waits for their copies (on the host,
or, with a compute stream, by making that stream wait); `end_op` runs the swap-outs after it.
Swapped-out blocks keep their addresses, and their bytes are there only inside an op: outside
one, an access reads the block's last bytes while its old mapping lasts (`Residency`: until
another block takes its frame, or, when ops queued on the compute stream may still read that
mapping, until they have run), and faults after (sim).

An elastic lease (`ElasticPages`, sim): `add_chunks` grows the lease by chunks, `give_back`
returns whole chunks while the job runs (blocks leave, LRU first, until the rest fits; pages
beneath the blocks left move off the chunks; no block moves its address), and `set_limit`
moves the limit alone. Another thread asks for these with `defer`: they run at the start of the
session's next `step`, `begin_op` or `try_malloc`, or on a thread of its own (`run_if_idle`) as
soon as the session's thread is between its calls and ops.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidalcore.events import ALLOC, FREE
from tidalcore.pages import MAX_WASTE, owns_pages
from tidalcore.units import ALIGNMENT, BlockId, Bytes, Offset, align_up

from tidalclient.devices.pages import ElasticPages, Frames, PageSpace
from tidalclient.devices.streams import Completion, CopyStream, Stream
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
    executor_ids,
    size_text,
)
from tidalclient.executors.bestfit import BestFit
from tidalclient.executors.residency import Residency
from tidalclient.plans import OpSchedule, Plan
from tidalclient.recorder import TraceSink

if TYPE_CHECKING:
    from tidalclient.timeline import Timeline

log = logging.getLogger("tidalpool")

RANGE_PER_LEASE = 16
"""The range a session reserves, in device leases: a quarter of it for each online part and
half for a plan's region (addresses cost nothing until pages are mapped beneath them)."""


def _mapped_peak(plan: Plan) -> int:
    """The most bytes `plan` maps at once (a paged plan says; else its limit): under a limit
    at least that, it runs as made, whatever limit it was made for."""
    return plan.paging.mapped_peak if plan.paging is not None else plan.limit


_CLOSE_WAIT_S = 5.0
"""How long `close` waits for work another thread runs on the executor (a give-back)."""


def range_bytes(lease: int, page: int) -> int:
    """The virtual range reserved for a lease of `lease` bytes, in whole pages."""
    return align_up(RANGE_PER_LEASE * max(lease, page), 4 * page)


@dataclass(slots=True, eq=False)
class _Live:
    block: Block
    owning: bool
    slot: int = -1  # the plan allocation it is (its address is the plan's), -1: placed online
    fit: BestFit | None = None  # the online part it was placed in (its bytes go back there)
    locks: int = 0
    pinned: bool = False


class Paged:
    """Blocks at addresses for life in `space`, with at most `limit` bytes of the lease's
    pages (`frames`) mapped beneath them; swapped bytes wait in the host lease at
    `host_address` (`host_capacity` bytes). `gbps` throttles the sim copy streams;
    `streams(gbps)` makes the out and in streams instead (cuda); `compute()`, when given, is
    the stream the ops' work runs on, which copies are ordered against. `trace` gets the
    allocations, frees and step marks. The executor owns `space` and closes it."""

    def __init__(
        self,
        space: PageSpace,
        frames: Frames,
        *,
        host_address: int,
        host_capacity: int,
        limit: int,
        trace: TraceSink | None = None,
        gbps: float | None = None,
        streams: Callable[[float | None], tuple[CopyStream, CopyStream]] | None = None,
        compute: Callable[[], Any] | None = None,
    ) -> None:
        page = space.page
        if page & (page - 1) or page % ALIGNMENT:
            raise ValueError(f"a page of {page} bytes: not a power of two multiple of {ALIGNMENT}")
        self._limit_pages = min(limit, frames.usable * page) // page
        if self._limit_pages < 1:
            raise ValueError(f"a limit of {limit} bytes is under one page of {page} bytes")
        if space.length % (4 * page):
            raise ValueError(f"a range of {space.length} bytes is not four parts of whole pages")
        quarter = space.length // 4
        self.space = space
        self.page = page
        self._session = next(executor_ids)
        self._own_fit = BestFit(quarter, page)  # at 0
        self._packed_fit = BestFit(quarter, ALIGNMENT)  # at `quarter`
        self._packed_base = quarter
        self._region = 2 * quarter  # plans' regions start here or past their live blocks
        self._base = self._region  # where the region of the plan run lies
        if streams is None:
            self._out: CopyStream = Stream("swap-out", gbps)
            self._in: CopyStream = Stream("swap-in", gbps)
        else:
            self._out, self._in = streams(gbps)
        self._compute = compute
        self._frames = frames
        self.residency = Residency(space, frames, host_address, host_capacity, self._out, self._in)
        self._trace = trace
        self._live: dict[int, _Live] = {}
        self._lru: OrderedDict[int, _Live] = OrderedDict()  # page-owning, least recent first
        self._starts: list[int] = []  # the region's live blocks: their addresses, sorted
        self._ends: dict[int, int] = {}  # address -> end, of the same
        self._next_id = 1
        self._iteration = 0
        self._op_index = 0
        self._tick = 0  # events (mallocs, frees, ops) of this iteration so far
        self._iter_ids: list[int] = []  # this iteration's blocks by allocation index
        self._pending_plan: Plan | None = None  # from the connection's thread
        self._online = False  # install_plan(None): no plan from the next step
        self._plan: Plan | None = None
        self._schedule: OpSchedule | None = None
        self._waiting_ins: list[int] = []  # swaps issued whose pages did not fit yet
        self._limit = min(limit, frames.usable * page)  # as asked: whole pages count under it
        self._deferred: deque[Callable[[Paged], None]] = deque()  # from other threads
        # Held by the session's thread inside every call and from an op's begin to its end:
        # deferred work runs on another thread only while it is free (`run_if_idle`).
        self._busy = threading.RLock()
        self._ops_open = 0
        # The lease grows and shrinks while the session runs (set by its elastic lease): a plan
        # for more than the limit now waits for chunks instead of being refused.
        self.elastic = False
        self.live_bytes = self.peak_live_bytes = 0
        self.mallocs = self.frees = 0
        self.plan_hits = self.plan_misses = 0
        self.planned_out_bytes = self.planned_in_bytes = 0
        self.schedule_skips = 0
        self.plans_refused = 0

    # -- what it is ----------------------------------------------------------------------------
    @property
    def session(self) -> int:
        return self._session

    @property
    def capacity(self) -> int:
        return self._limit

    @property
    def alignment(self) -> int:
        return ALIGNMENT

    @property
    def used_bytes(self) -> int:
        """Bytes mapped now (the pages of resident blocks and of copies out in flight)."""
        return self.residency.mapped_bytes

    @property
    def largest_free(self) -> int:
        """Any free pages serve any block: the bytes that may still be mapped."""
        return max(0, self._limit_pages * self.page - self.residency.mapped_bytes)

    @property
    def timeline(self) -> Timeline | None:
        """Where the copies and the waits go as spans (`tidalclient.timeline`; None: nowhere)."""
        return self.residency.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self.residency.timeline = timeline

    def _mapped_pages(self) -> int:
        return self.residency.held_pages

    # -- blocks ------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        block = self.try_malloc(nbytes)
        if block is None:
            raise LeaseExceeded(
                f"cannot place {size_text(check_size(nbytes))}: {size_text(self.used_bytes)} are"
                f" mapped of the limit {size_text(self._limit)}, and no block can leave (every"
                " page-owning block is held by an op or pinned, or the host lease is full)"
            )
        return block

    def try_malloc(self, nbytes: int) -> Block | None:
        with self._busy:
            return self._try_malloc(nbytes)

    def _try_malloc(self, nbytes: int) -> Block | None:
        if self._deferred:
            self._run_deferred()
        nbytes = check_size(nbytes)
        self.residency.poll()
        index = len(self._iter_ids)
        found = self._planned(index, nbytes)
        if found is not None:
            offset, owning, slot = found
            fit = None
        else:
            owning = owns_pages(nbytes, self.page, MAX_WASTE)
            fit = self._own_fit if owning else self._packed_fit
            got = fit.allocate(align_up(nbytes, self.page) if owning else nbytes)
            if got is None:
                return None  # the range's online part is full: never under a limit
            offset, slot = got + (0 if owning else self._packed_base), -1
        block_id = self._next_id
        if not self._room(self.residency.new_pages(offset, nbytes, owning), block_id):
            if fit is not None:
                fit.release(offset - (0 if owning else self._packed_base))
            return None
        placed = self.residency.place(block_id, offset, nbytes, owning)
        assert placed  # `_room` made room
        self._next_id += 1
        block = Block(BlockId(block_id), Offset(offset), Bytes(nbytes), self._session)
        live = _Live(block, owning, slot, fit)
        self._live[block_id] = live
        if owning:
            self._lru[block_id] = live
        if slot >= 0:
            self._claim(offset, nbytes)
            self.plan_hits += 1
        elif self._plan is not None:
            self.plan_misses += 1
        self._iter_ids.append(block_id)
        self._tick += 1
        self.mallocs += 1
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        if self._trace is not None:
            self._trace.record(ALLOC, block_id, nbytes)
        self._land_waiting()
        return block

    def _planned(self, index: int, nbytes: int) -> tuple[int, bool, int] | None:
        """Where the plan puts allocation `index` of `nbytes`: (offset, owning, slot), or None
        when there is no plan, it did not foresee this allocation, or its bytes are held."""
        plan = self._plan
        if plan is None or plan.paging is None or index >= len(plan.table.sizes):
            return None
        if plan.table.sizes[index] != nbytes:
            return None
        offset = self._base + plan.table.offsets[index]
        if self._taken(offset, nbytes):
            return None
        return offset, plan.paging.owning[index], index

    def _taken(self, offset: int, nbytes: int) -> bool:
        """Whether a live block of the region lies on any of [offset, offset + nbytes)."""
        k = bisect.bisect_left(self._starts, offset + nbytes)
        return k > 0 and self._ends[self._starts[k - 1]] > offset

    def _claim(self, offset: int, nbytes: int) -> None:
        bisect.insort(self._starts, offset)
        self._ends[offset] = offset + nbytes

    def free(self, block: Block) -> None:
        with self._busy:
            return self._free(block)

    def _free(self, block: Block) -> None:
        live = self._entry(block)
        if live.locks:
            raise InvalidBlock(f"{describe(block)} is in use by an op")
        del self._live[block.id]
        self._lru.pop(block.id, None)
        # Its pages and host bytes: now, or once its copy or the compute work using it ends.
        self.residency.drop(block.id, self._after())
        if live.slot >= 0:
            self._starts.remove(block.offset)
            del self._ends[block.offset]
        elif live.fit is not None:
            base = 0 if live.owning else self._packed_base
            live.fit.release(block.offset - base)
        self._tick += 1
        self.frees += 1
        self.live_bytes -= block.size
        if self._trace is not None:
            self._trace.record(FREE, block.id, 0)
        self._land_waiting()

    def _entry(self, block: Block) -> _Live:
        live = self._live.get(block.id)
        if block.session != self._session or live is None or live.block != block:
            raise InvalidBlock(f"{describe(block)} is not live in this session")
        return live

    def pin(self, block: Block) -> None:
        with self._busy:
            return self._pin(block)

    def _pin(self, block: Block) -> None:
        """Keep the block on the device for good (an array holds its address)."""
        live = self._entry(block)
        self._bring([live], on_demand=True)
        live.locks -= 1
        live.pinned = True
        self._lru.pop(block.id, None)

    def offset(self, block: Block) -> int:
        """The block's address in the range: the same from malloc to free."""
        return self._entry(block).block.offset

    def where(self, block: Block) -> str:
        self.residency.poll()
        return self.residency.where(self._entry(block).block.id)

    def swap_out(self, block: Block) -> bool:
        with self._busy:
            return self._swap_out(block)

    def _swap_out(self, block: Block) -> bool:
        """Start copying the block out now; False when it does not own pages, is held by an op
        or pinned, is not on the device, or the host lease has no room."""
        live = self._entry(block)
        if not live.owning or live.locks or live.pinned:
            return False
        if self.residency.where(block.id) != DEVICE:
            return False
        return self._evict(live)

    def prefetch(self, block: Block) -> None:
        with self._busy:
            return self._prefetch(block)

    def _prefetch(self, block: Block) -> None:
        """Start bringing the block back now when its pages fit under the limit."""
        live = self._entry(block)
        if self.residency.where(block.id) in (HOST, LEAVING):
            self._restore(live, wait=False)

    # -- making room ---------------------------------------------------------------------------
    def _room(self, pages: int, keep: int = -1) -> bool:
        """Make the mapped pages plus `pages` fit under the limit: finished copies out give
        theirs back, then the oldest copy in flight is waited for, then the least recently
        used page-owning block no op holds leaves (not `keep`). False when nothing can."""
        res = self.residency
        while self._mapped_pages() + pages > self._limit_pages:
            res.poll()
            if self._mapped_pages() + pages <= self._limit_pages:
                break
            if res.in_flight:
                res.reclaim()
                continue
            victim = next(
                (
                    v
                    for k, v in self._lru.items()
                    if k != keep and not v.locks and not v.pinned and res.where(k) == DEVICE
                ),
                None,
            )
            if victim is None or not self._evict(victim):
                return False
        return True

    def _after(self) -> Completion | None:
        """The compute work enqueued so far, which a copy must follow (None: ran on this
        thread)."""
        stream = self._compute() if self._compute is not None else None
        return stream.record() if stream is not None else None

    def _evict(self, live: _Live, planned: bool = False) -> bool:
        block_id = live.block.id
        if not self.residency.evict(block_id, self._after()):
            return False
        self._lru.pop(block_id, None)
        if planned:
            self.planned_out_bytes += align_up(live.block.size, self.page)
        return True

    def _restore(self, live: _Live, wait: bool, planned: bool = False) -> bool:
        """Bring a block away back: its pages mapped (making room only when `wait`) and its
        copy in issued. False when its pages do not fit (and `wait` is False)."""
        block_id = live.block.id
        pages = self.residency.pages_back(block_id)
        if wait:
            if not self._room(pages, block_id):
                raise LeaseExceeded(
                    f"cannot bring back {describe(live.block)}: no room under the limit"
                    f" {size_text(self._limit)} and no block can leave"
                )
        elif self._mapped_pages() + pages > self._limit_pages:
            self.residency.poll()
            if self._mapped_pages() + pages > self._limit_pages:
                return False
        restored = self.residency.restore(block_id)
        assert restored
        if planned and pages:
            self.planned_in_bytes += pages * self.page
        if live.owning and not live.pinned:
            self._lru[block_id] = live
            self._lru.move_to_end(block_id)
        return True

    def _bring(self, lives: Sequence[_Live], on_demand: bool) -> None:
        """Make `lives` resident, locked, and wait for their copies in."""
        for live in lives:
            live.locks += 1  # first: bringing one in must not send another out
        try:
            for live in lives:
                if self.residency.where(live.block.id) in (HOST, LEAVING):
                    self._restore(live, wait=True, planned=not on_demand)
        except BaseException:
            for live in lives:
                live.locks -= 1
            raise
        self._wait_for(lives)

    def _wait_for(self, lives: Sequence[_Live]) -> None:
        stream = self._compute() if self._compute is not None else None
        for live in lives:
            event = self.residency.ready(live.block.id)
            if event is None:
                continue
            if stream is not None:
                stream.wait_event(event)
            else:
                self.residency.wait(event, "copy in, for an op")

    def _land_waiting(self) -> None:
        """Issue the scheduled swap-ins that waited for pages, those that fit now."""
        schedule = self._schedule
        if not self._waiting_ins or schedule is None:
            return
        still = []
        for j in self._waiting_ins:
            live = self._resolve(j)
            if live is None or self.residency.where(live.block.id) not in (HOST, LEAVING):
                continue
            if (schedule.starts and schedule.starts[j] >= self._tick) or not self._restore(
                live, wait=False, planned=True
            ):
                still.append(j)
        self._waiting_ins = still

    def _resolve(self, j: int) -> _Live | None:
        assert self._schedule is not None
        persistent, ref = self._schedule.refs[j]
        if persistent:
            return self._live.get(ref)
        ids = self._iter_ids
        return self._live.get(ids[ref]) if ref < len(ids) else None

    # -- ops ---------------------------------------------------------------------------------
    def begin_op(self, blocks: Sequence[Block]) -> list[int]:
        """`_begin_op`, holding the executor until the op's `end_op`: work another thread
        runs when the session is idle (`run_if_idle`) never runs inside an op."""
        self._busy.acquire()
        try:
            offsets = self._begin_op(blocks)
        except BaseException:
            self._busy.release()
            raise
        self._ops_open += 1
        return offsets

    def end_op(self, blocks: Sequence[Block]) -> None:
        try:
            self._end_op(blocks)
        finally:
            if self._ops_open:
                self._ops_open -= 1
                self._busy.release()

    def _begin_op(self, blocks: Sequence[Block]) -> list[int]:
        """Hold `blocks` on the device for one op, bringing in and waiting for those away;
        issue the schedule's swap-ins of this op and wait for those it needs."""
        if self._deferred:
            self._run_deferred()
        lives = [self._entry(b) for b in blocks]
        self.residency.poll()
        self._tick += 1
        schedule = self._schedule
        needed: list[_Live] = []
        if schedule is not None:
            k = self._op_index
            self._land_waiting()
            for j in schedule.ins_at.get(k, ()):
                live = self._resolve(j)
                if live is None or self.residency.where(live.block.id) not in (HOST, LEAVING):
                    self.schedule_skips += live is None
                    continue
                if (schedule.starts and schedule.starts[j] >= self._tick) or not self._restore(
                    live, wait=False, planned=True
                ):
                    self._waiting_ins.append(j)
            for j in schedule.needed_before.get(k, ()):
                live = self._resolve(j)
                if live is None:
                    self.schedule_skips += 1
                    continue
                if j in self._waiting_ins:
                    self._waiting_ins.remove(j)
                if self.residency.where(live.block.id) in (HOST, LEAVING):
                    self._restore(live, wait=True, planned=True)
                needed.append(live)
        self._bring(lives, on_demand=True)
        self._wait_for([n for n in needed if n not in lives])
        for live in lives:
            if live.block.id in self._lru:
                self._lru.move_to_end(live.block.id)
        return [live.block.offset for live in lives]

    def _end_op(self, blocks: Sequence[Block]) -> None:
        """Release the op's blocks and run the swap-outs after it."""
        for b in blocks:
            live = self._live.get(b.id)
            if live is not None and live.locks:
                live.locks -= 1
        schedule = self._schedule
        if schedule is not None:
            for j in schedule.outs_after.get(self._op_index, ()):
                live = self._resolve(j)
                if live is None or not live.owning or live.locks or live.pinned:
                    self.schedule_skips += 1
                    continue
                where = self.residency.where(live.block.id)
                if where == ARRIVING:  # still landing: the copy out follows the copy in
                    event = self.residency.ready(live.block.id)
                    assert event is not None
                    self.residency.wait(event, "its copy in, to send it out")
                    self.residency.poll()
                    where = self.residency.where(live.block.id)
                if where != DEVICE or not self._evict(live, planned=True):
                    self.schedule_skips += 1
        self._op_index += 1

    # -- iterations and plans ----------------------------------------------------------------
    def install_plan(self, plan: Plan | None) -> None:
        """Run this plan from the next `step()` on (the plan in use again: where it is); None:
        place online (learning) from the next `step()` on. Thread-safe: it only replaces
        values."""
        self._online = plan is None  # before the plan: a step that takes the plan sees this
        self._pending_plan = plan

    def _region_for(self, plan: Plan) -> int | str:
        """Where `plan`'s region lies (past every live block of an earlier plan's region: no
        block moves), or why this session cannot run it."""
        paging = plan.paging
        if paging is None:
            return "it is not a paged plan (version 3): its offsets are not addresses for life"
        if paging.page != self.page:
            return f"its pages are of {paging.page} bytes, this session's of {self.page}"
        if not 0 < plan.limit <= self._limit:
            return f"it was made for {plan.limit} bytes, over this session's limit {self._limit}"
        base = max(
            [self._region]
            + [
                align_up(v.block.offset + v.block.size, self.page)
                for v in self._live.values()
                if v.block.offset >= self._region
            ]
        )
        if base + paging.region_bytes > self.space.length:
            return (
                f"its region of {size_text(paging.region_bytes)} does not fit in the"
                f" {size_text(self.space.length - base)} left of this session's range past its"
                " live blocks"
            )
        return base

    def step(self) -> int:
        with self._busy:
            return self._step()

    def _step(self) -> int:
        if self._deferred:
            self._run_deferred()
        self._take_pending()
        self.residency.poll()
        self._waiting_ins.clear()
        self._op_index = 0
        self._tick = 0
        self._iter_ids = []
        self._iteration += 1
        if self._trace is not None:  # where the live blocks are: a next plan keeps them there
            self._trace.step(self._iteration, self.placed())
        return self._iteration

    def switch_plan(self, plan: Plan | None) -> None:
        """Run `plan` (None: none) for the iteration just begun instead of the one its `step()`
        took, from its next op on, as if installed before that step: the iteration has
        allocated nothing yet (RuntimeError otherwise). Swap-ins the plan before issued stay
        on their way; those it left waiting for pages come when an op needs them."""
        with self._busy:
            if self._iter_ids:
                raise RuntimeError("the iteration has allocated already: its plan stays")
            self.install_plan(plan)
            self._take_pending()
            self._waiting_ins.clear()  # swaps of the plan before, by its numbering
            self._catch_up()

    def _catch_up(self) -> None:
        """Where the schedule taken within an iteration would be after its ops so far: blocks
        it has away by now leave, those it is bringing back by now come, and blocks the plan
        before sent away that it keeps on the device come back. Only persistent blocks are
        concerned (the iteration has allocated nothing yet); a swap across the boundary is left
        as it is (its block may stay until it is needed)."""
        k = self._op_index
        if not k:
            return
        schedule = self._schedule
        scheduled: set[int] = set()  # blocks the schedule moves around op k: left to it
        if schedule is not None:
            issued = {j: at for at, swaps in schedule.ins_at.items() for j in swaps}
            for j, ((persistent, ref), out, back) in enumerate(
                zip(schedule.refs, schedule.out_after, schedule.in_before, strict=True)
            ):
                if not persistent:
                    continue
                if back <= out:  # across the boundary: left as it is
                    scheduled.add(ref)
                    continue
                if not out < k <= back:
                    continue
                scheduled.add(ref)
                if issued[j] < k:  # on its way back by now
                    self._waiting_ins.append(j)
                    continue
                live = self._resolve(j)
                if (
                    live is not None
                    and live.owning
                    and not (live.locks or live.pinned)
                    and self.residency.where(live.block.id) == DEVICE
                ):
                    self._evict(live, planned=True)
        for block_id, live in self._live.items():
            if block_id not in scheduled and self.residency.where(block_id) in (HOST, LEAVING):
                self._restore(live, wait=False)
        self._land_waiting()

    def _take_pending(self) -> None:
        """Leave the plan in use, or take the plan installed (unless it cannot run here)."""
        plan, self._pending_plan = self._pending_plan, None
        if self._online:
            self._online = False
            self._plan = self._schedule = None
        elif plan is not None and plan is not self._plan:  # the plan in use stays where it is
            if self._growing(plan):
                # Made for the quota an elastic lease is growing to: it waits for the chunks,
                # unless a newer plan comes first.
                if self._pending_plan is None:
                    self._pending_plan = plan
            elif isinstance(base := self._region_for(plan), str):
                self.plans_refused += 1
                log.warning("tidalpool: plan %d is not run: %s", plan.plan_id, base)
            else:
                self._plan, self._base = plan, base
                self._schedule = (
                    OpSchedule.build(plan.swaps, starts=plan.swap_in_ticks) if plan.swaps else None
                )

    # -- an elastic lease ----------------------------------------------------------------------
    def defer(self, fn: Callable[[Paged], None]) -> None:
        """Run `fn(self)` on the session's thread at the start of its next `step`, `begin_op`
        or `try_malloc`, before anything else there, in the order deferred, once. Thread-safe
        (one append); an exception from `fn` is raised to that call, and the functions
        deferred after it run at the next one."""
        self._deferred.append(fn)

    def run_if_idle(self, timeout: float) -> bool:
        """Run the deferred work on the calling thread as soon as the session's thread is
        outside the executor (between its calls and ops), waiting up to `timeout` seconds for
        that; False when it was busy throughout. An exception from the work is raised here."""
        if not self._busy.acquire(timeout=timeout):
            return False
        try:
            self._run_deferred()
        finally:
            self._busy.release()
        return True

    @property
    def deferred(self) -> int:
        """Deferred work not run yet."""
        return len(self._deferred)

    def _run_deferred(self) -> None:
        while self._deferred:
            self._deferred.popleft()(self)

    def _elastic(self) -> ElasticPages:
        space = self.space
        if not isinstance(space, ElasticPages):
            raise TypeError(
                f"this session's {type(space).__name__} has a fixed lease: it cannot grow or"
                " give chunks back"
            )
        return space

    @property
    def slots(self) -> list[int]:
        """The chunk slots of the lease now, ascending (TypeError: not an elastic lease)."""
        return self._elastic().slots

    def set_limit(self, limit: int) -> None:
        """Run under `limit` bytes from now on (whole pages count; at most the lease's). A lower
        limit makes room at once, as an allocation would (copies waited for, least recently
        used blocks out); what cannot leave now (held by an op, pinned, no host room) stays
        mapped over it until it can, and the next allocation makes room again. A plan that
        maps more than the limit at its peak stops at once: blocks are placed online until one
        fits; one that maps less runs on, whatever limit it was made for."""
        page = self.page
        capped = min(limit, self._frames.usable * page)
        if capped < page:
            raise ValueError(f"a limit of {limit} bytes is under one page of {page} bytes")
        self._limit, self._limit_pages = capped, capped // page
        if self._plan is not None and _mapped_peak(self._plan) > capped:
            log.info(
                "tidalpool: plan %d was made for %d bytes, over the new limit %d: placing online",
                self._plan.plan_id,
                self._plan.limit,
                capped,
            )
            self._plan = self._schedule = None
            self._waiting_ins.clear()
        self._room(0)

    def add_chunks(self, fds: Sequence[int], limit: int) -> list[int]:
        """Grow the lease by a chunk for each of `fds` (the space keeps duplicates: the caller
        closes its own), then run under `limit` bytes (`set_limit`): the new chunks' slots.
        All of them or none."""
        space = self._elastic()
        added: list[int] = []
        try:
            for fd in fds:
                added.append(space.add_chunk(fd))
                frames = self._frames.add(space.per_chunk)
                assert frames.stop == space.frames, "the frames and the space disagree"
                self.residency.grow(space.per_chunk)
        except BaseException:
            for slot in added:  # unused: their frames leave again
                space.drop_chunk(slot)
                first = slot * space.per_chunk
                self._frames.withdraw(range(first, first + space.per_chunk))
            raise
        self.set_limit(limit)
        return added

    def give_back(self, count: int, limit: int) -> list[int]:
        """Give `count` whole chunks of the lease back while the session runs, then run under
        `limit` bytes (at most what is left): the slots given back, those with the fewest
        frames beneath blocks. The copies in flight finish and the compute work is waited for;
        least recently used page-owning blocks (not held by an op, not pinned) leave until the
        pages held fit the new limit; the pages beneath the blocks left move off the chunks
        (same addresses, same bytes). LeaseExceeded, before anything moves, when the blocks
        that cannot leave (held, pinned, packed) hold more than fits; a full host lease is
        found only while blocks leave (those that left stay away). Every chunk (`count` the
        number of slots) is LeaseExceeded too: a session keeps one at least."""
        space = self._elastic()
        slots = space.slots
        if not 0 <= count <= len(slots):
            raise ValueError(f"cannot give back {count} of the lease's {len(slots)} chunks")
        if count == len(slots):
            raise LeaseExceeded(
                f"cannot give back all {count} chunks of the lease: a session keeps one at least"
            )
        page, per_chunk, res = self.page, space.per_chunk, self.residency
        left = self._frames.usable - count * per_chunk
        target = min(limit, left * page) // page  # the pages the blocks may hold after
        if target < 1:
            raise ValueError(f"a limit of {limit} bytes is under one page of {page} bytes")
        self._settle()
        victims: list[_Live] = []
        freed = 0
        over = res.held_pages - target
        for k, live in self._lru.items():
            if freed >= over:
                break
            if not live.locks and not live.pinned and res.where(k) == DEVICE:
                victims.append(live)
                freed += res.new_pages(live.block.offset, live.block.size, owning=True)
        if freed < over:
            raise LeaseExceeded(
                f"cannot give back {count} of the {len(slots)} chunks of"
                f" {size_text(per_chunk * page)}: {size_text((res.held_pages - freed) * page)}"
                " stay mapped (blocks held by an op or pinned, packed pages), over the"
                f" {size_text(target * page)} left"
            )
        for live in victims:
            if not self._evict(live):
                raise LeaseExceeded(
                    f"cannot give back {count} of the {len(slots)} chunks: the host lease has no"
                    f" room for {describe(live.block)}"
                )
        self._settle()
        taken = {k: self._frames.taken(range(k * per_chunk, (k + 1) * per_chunk)) for k in slots}
        chosen = sorted(sorted(slots, key=lambda k: (taken[k], -k))[:count])
        res.vacate([f for k in chosen for f in range(k * per_chunk, (k + 1) * per_chunk)])
        for k in chosen:
            space.drop_chunk(k)
        self.set_limit(limit)
        return chosen

    def _settle(self) -> None:
        """Wait for the compute work enqueued so far and for every copy in flight."""
        after = self._after()
        if after is not None:
            self.residency.wait(after, "compute, to give chunks back")
        while self.residency.reclaim():
            pass
        self.residency.poll()

    def _growing(self, plan: Plan) -> bool:
        """Whether `plan` is for more than the limit now of an elastic lease, which may grow
        to it (the daemon plans for the quota it sent; its chunks may come later)."""
        return self._limit < plan.limit and self.elastic

    def placed(self) -> tuple[tuple[int, int, bool], ...]:
        """Every live block: (id, address in the range, whether it owns whole pages)."""
        return tuple((k, v.block.offset, v.owning) for k, v in self._live.items())

    def stats(self) -> ExecutorStats:
        res = self.residency
        swapped_out = res.out_bytes
        swapped_in = res.in_bytes
        return ExecutorStats(
            live_bytes=self.live_bytes,
            peak_live_bytes=self.peak_live_bytes,
            used_bytes=res.mapped_bytes,
            live_blocks=len(self._live),
            mallocs=self.mallocs,
            frees=self.frees,
            mode="planned" if self._plan is not None else "learning",
            plan_hits=self.plan_hits,
            plan_misses=self.plan_misses,
            high_water=res.peak_mapped_bytes,
            swap=SwapStats(
                limit=self._limit,
                resident_bytes=res.mapped_bytes,
                peak_resident_bytes=res.peak_mapped_bytes,
                swapped_out_bytes=swapped_out,
                swapped_in_bytes=swapped_in,
                swap_outs=res.swap_outs,
                swap_ins=res.swap_ins,
                stall_ns=res.stall_ns,
                scheduled_swaps=self._schedule.swaps if self._schedule is not None else 0,
                schedule_skips=self.schedule_skips,
                host_used_bytes=res.host_used_bytes,
                planned_out_bytes=self.planned_out_bytes,
                planned_in_bytes=self.planned_in_bytes,
                on_demand_out_bytes=swapped_out - self.planned_out_bytes,
                on_demand_in_bytes=swapped_in - self.planned_in_bytes,
            ),
        )

    def synchronize(self) -> None:
        """Wait for every copy in flight and settle it."""
        with self._busy:
            self.residency.close()

    def close(self) -> None:
        """Finish the copies in flight, stop the streams and retire the range: no page of
        the lease stays reachable through it. Idempotent. Work another thread runs on it
        (`run_if_idle`) finishes first (waited for a few seconds at most)."""
        held = self._busy.acquire(timeout=_CLOSE_WAIT_S)
        try:
            self.residency.close()
            self._out.close()
            self._in.close()
            self.space.retire()
        finally:
            if held:
                self._busy.release()
