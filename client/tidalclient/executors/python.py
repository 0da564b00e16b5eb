"""The executor of blocks placed in Python: online best-fit while learning, a plan's arena once
the daemon has sent one.

Learning mode: each block is placed online by `BestFit` (`bestfit.py`). Planned mode: allocation
i of an iteration takes slot i of the plan's arena (`arena.py`) when it can, else it is a miss,
placed online. Every malloc and free goes to the trace, and each `step()` marks an iteration.

Blocks never move here. An adaptor that moves them (`swapping.py`) takes a block's bytes with
`vacate` and puts blocks on bytes it asks for with `reserve`: from then on those bytes are the
adaptor's to `release`, and `free` of a vacated block only ends the block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from tidalcore.events import ALLOC, FREE
from tidalcore.units import ALIGNMENT, BlockId, Bytes, Offset, align_up

from tidalclient.errors import InvalidBlock, LeaseExceeded
from tidalclient.executors.arena import Arena
from tidalclient.executors.base import (
    Block,
    ExecutorStats,
    check_size,
    describe,
    executor_ids,
    size_text,
)
from tidalclient.executors.bestfit import BestFit
from tidalclient.plans import Plan, PlanTable
from tidalclient.recorder import TraceSink


class PythonExecutor:
    """Allocates blocks inside one session's lease and records every malloc and free."""

    __slots__ = (
        "_arena",
        "_blocks",
        "_fit",
        "_frees",
        "_high_water",
        "_iteration",
        "_live_bytes",
        "_mallocs",
        "_next_id",
        "_online",
        "_peak_live_bytes",
        "_pending",
        "_record",
        "_session",
        "_trace",
        "_vacated",
        "last_footprint",
        "max_iteration_misses",
        "plan_fallbacks",
        "plan_hits_before",
        "plan_misses_before",
    )

    def __init__(
        self, capacity: int, alignment: int = ALIGNMENT, trace: TraceSink | None = None
    ) -> None:
        self._fit = BestFit(capacity, alignment)
        self._trace = trace
        self._record = trace.record if trace is not None else None
        self._session = next(executor_ids)
        self._blocks: dict[int, Block] = {}
        self._vacated: set[int] = set()  # live blocks whose bytes an adaptor took
        self._next_id = 1
        self._iteration = 0
        self._live_bytes = 0
        self._peak_live_bytes = 0
        self._mallocs = 0
        self._frees = 0
        self._arena: Arena | None = None  # the plan in use (or draining)
        self._pending: PlanTable | None = None  # a plan to switch to at the next iteration
        self._online = False  # leave the plan in use at the next iteration (install_plan(None))
        self._high_water = 0  # highest lease byte handed out in this iteration
        self.last_footprint = 0  # the same, for the last complete iteration
        self.max_iteration_misses = 8  # more misses than this in one iteration: back to learning
        self.plan_fallbacks = 0
        self.plan_hits_before = 0  # hits and misses of arenas already dropped
        self.plan_misses_before = 0

    # -- blocks ------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        """A new live block of `nbytes`; LeaseExceeded when it does not fit in the lease now."""
        block = self.try_malloc(nbytes)
        if block is None:
            raise self._exceeded(nbytes)
        return block

    def try_malloc(self, nbytes: int) -> Block | None:
        """A new live block of `nbytes`, or None when it does not fit in the lease now
        (ValueError for a size that is not positive, TypeError for one that is no integer)."""
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_size(nbytes)
        block_id = self._next_id
        arena = self._arena
        offset = arena.take(nbytes, block_id) if arena is not None else None
        if offset is None:
            offset = self._fit.allocate(nbytes)
            if offset is None:
                return None
        self._next_id = block_id + 1
        end = offset + nbytes
        if end > self._high_water:
            self._high_water = end
        block = Block(BlockId(block_id), Offset(offset), Bytes(nbytes), self._session)
        self._blocks[block_id] = block
        self._mallocs += 1
        live = self._live_bytes + nbytes
        self._live_bytes = live
        if live > self._peak_live_bytes:
            self._peak_live_bytes = live
        if self._record is not None:
            self._record(ALLOC, block_id, nbytes)
        return block

    def free(self, block: Block) -> None:
        """Return a live block's bytes; InvalidBlock (state untouched) for a foreign or dead one."""
        if block.session != self._session:
            raise InvalidBlock(f"{describe(block)} belongs to another session")
        live = self._blocks.get(block.id)
        if live is None or (live is not block and live != block):
            raise InvalidBlock(f"{describe(block)} is not live (already freed?)")
        if self._vacated and block.id in self._vacated:
            self._vacated.discard(block.id)  # its bytes are an adaptor's
        else:
            self._unplace(block.id, block.offset)
        del self._blocks[block.id]
        self._frees += 1
        self._live_bytes -= block.size
        if self._record is not None:
            self._record(FREE, block.id, 0)

    def _live(self, block: Block) -> None:
        if block.session != self._session:
            raise InvalidBlock(f"{describe(block)} belongs to another session")
        live = self._blocks.get(block.id)
        if live is None or (live is not block and live != block):
            raise InvalidBlock(f"{describe(block)} is not live (already freed?)")

    def _unplace(self, block_id: int, offset: int) -> None:
        """A block's bytes back to the arena or the fit."""
        arena = self._arena
        if arena is None or not arena.release(block_id):
            self._fit.release(offset)
        elif not arena.active and not arena.live:
            self._drop_arena()

    def offset(self, block: Block) -> int:
        """The block's lease offset; InvalidBlock when an adaptor has taken its bytes."""
        if self._vacated and block.id in self._vacated:
            raise InvalidBlock(f"{describe(block)} has no device bytes of its own now")
        return block.offset

    # -- raw bytes, for adaptors that move blocks ---------------------------------------------
    def vacate(self, block: Block) -> Callable[[], None]:
        """Take a live block's bytes from it (it stays live, without bytes): they stay held
        until the returned function gives them back."""
        self._live(block)
        if block.id in self._vacated:
            raise InvalidBlock(f"{describe(block)} has no device bytes of its own now")
        self._vacated.add(block.id)
        return functools.partial(self._unplace, block.id, block.offset)

    def reserve(self, nbytes: int) -> int | None:
        """An offset of `nbytes` raw device bytes, placed online (None when none fit)."""
        offset = self._fit.allocate(nbytes)
        if offset is not None and offset + nbytes > self._high_water:
            self._high_water = offset + nbytes
        return offset

    def release(self, offset: int) -> None:
        """Give back bytes from `reserve`."""
        self._fit.release(offset)

    # -- a plan's slots, for an adaptor that executes its swaps --------------------------------
    def plan_fits(self, nbytes: int) -> bool:
        """Whether the next malloc of `nbytes` takes its slot of the plan in use (no bytes
        beyond the arena's)."""
        arena = self._arena
        return arena is not None and arena.would_take(nbytes)

    def slot(self, block_id: int) -> int | None:
        """The plan slot a live block (or a piece an adaptor reserved for it) holds, if any."""
        arena = self._arena
        return None if arena is None else arena.slot_of.get(block_id)

    def reserve_piece(self, slot: int, block_id: int) -> int | None:
        """The lease offset of a piece's slot of the plan in use, held for `block_id` until
        `release_piece`; None while the slot or one sharing its bytes is held."""
        arena = self._arena
        if arena is None:
            return None
        offset = arena.take_slot(slot, block_id)
        if offset is not None:
            self._high_water = max(self._high_water, offset + self._arena_slot_size(slot))
        return offset

    def release_piece(self, block_id: int) -> None:
        """Give back the slot `reserve_piece` held for `block_id`."""
        arena = self._arena
        if arena is None or not arena.release(block_id):
            raise InvalidBlock(f"block {block_id} holds no piece of a plan")
        if not arena.active and not arena.live:
            self._drop_arena()

    def _arena_slot_size(self, slot: int) -> int:
        assert self._arena is not None
        table = self._arena.table
        n = len(table.sizes)
        return table.sizes[slot] if slot < n else table.pieces[slot - n][0]

    @property
    def plan_table(self) -> PlanTable | None:
        """The table of the plan whose arena is held (in use, or draining after a fallback)."""
        arena = self._arena
        return arena.table if arena is not None else None

    @property
    def arena_bytes(self) -> int:
        """Lease bytes the plan's arena holds (0: none)."""
        arena = self._arena
        return align_up(arena.table.height, self._fit.alignment) if arena is not None else 0

    # -- iterations ---------------------------------------------------------------------
    def install_plan(self, plan: Plan | None) -> None:
        """Use this plan's placement from the next `step()` on (when its arena fits); its swaps
        are for an adaptor that swaps. None: place online (learning) from the next `step()`
        on."""
        self._pending = plan.table if plan is not None else None
        self._online = plan is None

    def step(self) -> int:
        """An iteration boundary: judge the plan in use, switch to a pending one, reset the
        iteration's counts, mark the trace; the new iteration's number."""
        arena = self._arena
        if (
            arena is not None
            and arena.active
            and arena.iteration_misses > self.max_iteration_misses
        ):
            arena.active = False  # back to learning; the arena goes when its last block does
            self.plan_fallbacks += 1
            if not arena.live:
                self._drop_arena()
        self._take_pending()
        self.last_footprint = self._high_water
        self._high_water = max((b.offset + b.size for b in self._blocks.values()), default=0)
        if self._arena is not None:
            self._high_water = max(self._high_water, self._arena.base + self._arena.table.height)
        self._iteration += 1
        if self._trace is not None:
            self._trace.step(self._iteration)
        return self._iteration

    def switch_plan(self, plan: Plan | None) -> None:
        """Run `plan` (None: place online) for the iteration just begun instead of the one its
        `step()` took, as if installed before that step: the iteration has allocated nothing
        yet (RuntimeError otherwise)."""
        if self._arena is not None and self._arena.cursor:
            raise RuntimeError("the iteration has allocated already: its plan stays")
        self.install_plan(plan)
        self._take_pending()
        if self._arena is not None:
            self._high_water = max(self._high_water, self._arena.base + self._arena.table.height)

    def _take_pending(self) -> None:
        """At an iteration's start: leave the plan in use for online placement, or take the
        plan installed, when its arena fits."""
        arena = self._arena
        if self._online:
            self._online = False
            if arena is not None and arena.active:
                arena.active = False  # as a fallback, but asked for
                if not arena.live:
                    self._drop_arena()
        if self._pending is not None and (self._arena is None or not self._arena.live):
            if self._arena is not None:
                self._drop_arena()
            base = self._fit.allocate(self._pending.height) if self._pending.height else 0
            if base is not None:  # no room for the arena now: stay learning, try next time
                self._arena = Arena(self._pending, base)
                self._pending = None
        if self._arena is not None:
            self._arena.begin_iteration()

    def _drop_arena(self) -> None:
        arena = self._arena
        assert arena is not None and not arena.live
        if arena.table.height:
            self._fit.release(arena.base)
        self.plan_hits_before += arena.hits
        self.plan_misses_before += arena.misses
        self._arena = None

    def close(self) -> None:
        """Release what the executor holds besides the lease (nothing)."""

    # -- views --------------------------------------------------------------------------------
    def stats(self) -> ExecutorStats:
        return ExecutorStats(
            live_bytes=self._live_bytes,
            peak_live_bytes=self._peak_live_bytes,
            used_bytes=self._fit.used_bytes,
            live_blocks=len(self._blocks),
            mallocs=self._mallocs,
            frees=self._frees,
            mode=self.mode,
            plan_hits=self.plan_hits,
            plan_misses=self.plan_misses,
            high_water=self._high_water,
        )

    @property
    def high_water(self) -> int:
        """The highest lease byte handed out in the current iteration so far."""
        return self._high_water

    @property
    def mode(self) -> str:
        """ "planned" while a plan serves allocations, else "learning"."""
        return "planned" if self._arena is not None and self._arena.active else "learning"

    @property
    def plan_hits(self) -> int:
        """Allocations served from a plan, over the executor's life."""
        return self.plan_hits_before + (self._arena.hits if self._arena is not None else 0)

    @property
    def plan_misses(self) -> int:
        """Planned-mode allocations that had to be placed online."""
        return self.plan_misses_before + (self._arena.misses if self._arena is not None else 0)

    def block(self, block_id: int) -> Block:
        """The live block with this id; InvalidBlock when there is none."""
        block = self._blocks.get(block_id)
        if block is None:
            raise InvalidBlock(f"block {block_id} is not live")
        return block

    def _exceeded(self, nbytes: int) -> LeaseExceeded:
        fit = self._fit
        rounded = align_up(nbytes, fit.alignment)
        asked = (
            size_text(nbytes) if rounded == nbytes else f"{size_text(nbytes)}, {rounded} aligned"
        )
        lease = size_text(fit.capacity)
        if rounded > fit.capacity:
            return LeaseExceeded(f"malloc of {asked} exceeds the lease of {lease}")
        return LeaseExceeded(
            f"malloc of {asked} does not fit now: {size_text(self._live_bytes)} live"
            f" in a lease of {lease}, largest free range {size_text(fit.largest_free)}"
        )

    @property
    def session(self) -> int:
        """This executor's process-unique id, carried by its blocks as `Block.session`."""
        return self._session

    @property
    def capacity(self) -> int:
        """The lease bytes usable for blocks (rounded down to the alignment)."""
        return self._fit.capacity

    @property
    def alignment(self) -> int:
        return self._fit.alignment

    @property
    def live_bytes(self) -> int:
        """Sum of the requested sizes of the live blocks."""
        return self._live_bytes

    @property
    def peak_live_bytes(self) -> int:
        return self._peak_live_bytes

    @property
    def used_bytes(self) -> int:
        """Sum of the rounded sizes of what is held: blocks, reservations, the plan's arena."""
        return self._fit.used_bytes

    @property
    def free_bytes(self) -> int:
        return self._fit.free_bytes

    @property
    def largest_free(self) -> int:
        return self._fit.largest_free

    @property
    def live_blocks(self) -> int:
        return len(self._blocks)

    @property
    def mallocs(self) -> int:
        return self._mallocs

    @property
    def frees(self) -> int:
        return self._frees

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range in the lease, sorted by offset."""
        return self._fit.free_ranges()
