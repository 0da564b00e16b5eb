"""Allocation inside a session's lease: an online best-fit allocator and the executor around it.

While the daemon is still learning the iteration, every `malloc` is placed online by `BestFit`:
the smallest free range that fits, ties to the lowest offset, carved from its low end; a release
merges the range with its free neighbours on both sides, so no two free ranges ever touch.

    lease [0, capacity)   (every boundary a multiple of the alignment)

    0          a            b        c                 d            capacity
    +----------+------------+--------+-----------------+------------+
    |  live    |   free F1  |  live  |     free F2     |    live    |
    +----------+------------+--------+-----------------+------------+

    _live     {0: a, b: c - b, d: capacity - d}   allocated start -> rounded size
    _by_start {a: b - a, c: d - c}                free start -> size     (right neighbour, O(1))
    _by_end   {b: a, d: c}                        free end -> start      (left neighbour, O(1))
    _by_size  [(b - a, a), (d - c, c)]            sorted (size, start): bisect finds the best fit

The module is pure: no I/O, no threads, no clock. `Executor` validates, numbers the blocks,
keeps the counters and calls the recorder; it turns `BestFit`'s "does not fit" (None) into a
`LeaseExceeded` that names the numbers.
"""

from __future__ import annotations

import itertools
import operator
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidalcore.events import ALLOC, FREE
from tidalcore.units import ALIGNMENT, BlockId, Bytes, Offset, align_up, format_size

from tidalclient.errors import InvalidBlock, LeaseExceeded
from tidalclient.planned import Arena, PlanTable

Recorder = Callable[[int, int, int], None]
"""`record(kind, block_id, size)`: called once per malloc (size = requested bytes) and free (0)."""

executor_ids = itertools.count(1)  # ids of executors (Python and native) in this process


class BestFit:
    """Online best-fit over [0, capacity) with coalescing of free neighbours."""

    __slots__ = (
        "_alignment",
        "_by_end",
        "_by_size",
        "_by_start",
        "_capacity",
        "_live",
        "_mask",
        "_notmask",
        "_used",
    )

    def __init__(self, capacity: int, alignment: int = ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self._alignment = alignment
        self._mask = alignment - 1
        self._notmask = ~(alignment - 1)
        self._capacity = capacity & ~(alignment - 1)
        self._live: dict[int, int] = {}
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        self._used = 0
        if self._capacity:
            self._by_start[0] = self._capacity
            self._by_end[self._capacity] = 0
            self._by_size.append((self._capacity, 0))

    def allocate(self, nbytes: int) -> int | None:
        """Place `nbytes` (rounded up to the alignment); the offset, or None when nothing fits."""
        if nbytes <= 0:
            raise ValueError(f"allocate of {nbytes} bytes: size must be positive")
        size = (nbytes + self._mask) & self._notmask
        by_size = self._by_size
        i = bisect_left(by_size, (size, -1))
        if i == len(by_size):
            return None
        free_size, offset = by_size.pop(i)
        del self._by_start[offset]
        end = offset + free_size
        if free_size > size:
            rest = offset + size
            insort(by_size, (free_size - size, rest), 0, i)  # it sorts below the hole
            self._by_start[rest] = free_size - size
            self._by_end[end] = rest
        else:
            del self._by_end[end]
        self._live[offset] = size
        self._used += size
        return offset

    def release(self, offset: int) -> int:
        """Free the range allocated at `offset`, merged with free neighbours; its rounded size."""
        try:
            size = self._live.pop(offset)
        except KeyError:
            raise KeyError(f"offset {offset} is not the start of an allocated range") from None
        self._used -= size
        start, end = offset, offset + size
        by_start, by_end, by_size = self._by_start, self._by_end, self._by_size
        right = by_start.pop(end, None)
        if right is not None:  # its by_end entry is overwritten below
            del by_size[bisect_left(by_size, (right, end))]
            end += right
        left = by_end.pop(start, None)
        if left is not None:  # its by_start entry is overwritten below
            del by_size[bisect_left(by_size, (start - left, left))]
            start = left
        by_start[start] = end - start
        by_end[end] = start
        insort(by_size, (end - start, start))
        return size

    @property
    def capacity(self) -> int:
        """The managed bytes: the constructor's capacity rounded down to the alignment."""
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used_bytes(self) -> int:
        """Sum of the rounded sizes of the live ranges."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def largest_free(self) -> int:
        """Size of the largest free range; 0 when none."""
        return self._by_size[-1][0] if self._by_size else 0

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range, sorted by offset (tests and debugging)."""
        return sorted(self._by_start.items())


@dataclass(frozen=True, slots=True)
class Block:
    """A live allocation: where it is in the lease, the size asked for, and its owning executor."""

    id: BlockId
    offset: Offset
    size: Bytes
    session: int


def _size(nbytes: int) -> str:
    """'512 bytes' or '1.5 KiB (1536 bytes)': readable and exact."""
    return f"{nbytes} bytes" if nbytes < 1024 else f"{format_size(nbytes)} ({nbytes} bytes)"


def _describe(block: Block) -> str:
    return f"block {block.id} (offset {block.offset}, {_size(block.size)})"


class Executor:
    """Allocates blocks inside one session's lease and records every malloc and free.

    Learning mode: each block is placed online by `BestFit` in `_place`, the one step a planned
    mode swaps for a table lookup.
    """

    __slots__ = (
        "_arena",
        "_blocks",
        "_fit",
        "_frees",
        "_high_water",
        "_live_bytes",
        "_mallocs",
        "_next_id",
        "_peak_live_bytes",
        "_pending",
        "_record",
        "_session",
        "last_footprint",
        "max_iteration_misses",
        "plan_fallbacks",
        "plan_hits_before",
        "plan_misses_before",
    )

    def __init__(
        self, capacity: int, alignment: int = ALIGNMENT, record: Recorder | None = None
    ) -> None:
        self._fit = BestFit(capacity, alignment)
        self._record = record
        self._session = next(executor_ids)
        self._blocks: dict[int, Block] = {}
        self._next_id = 1
        self._live_bytes = 0
        self._peak_live_bytes = 0
        self._mallocs = 0
        self._frees = 0
        self._arena: Arena | None = None  # the plan in use (or draining)
        self._pending: PlanTable | None = None  # a plan to switch to at the next iteration
        self._high_water = 0  # highest lease byte handed out in this iteration
        self.last_footprint = 0  # the same, for the last complete iteration
        self.max_iteration_misses = 8  # more misses than this in one iteration: back to learning
        self.plan_fallbacks = 0
        self.plan_hits_before = 0  # hits and misses of arenas already dropped
        self.plan_misses_before = 0

    def malloc(self, nbytes: int) -> Block:
        """A new live block of `nbytes`; LeaseExceeded when it does not fit in the lease now."""
        if type(nbytes) is not int:  # NumPy integers are fine; bools, floats, strings are not
            if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
                raise TypeError(f"malloc size must be an int, got {type(nbytes).__name__}")
            nbytes = operator.index(nbytes)
        if nbytes <= 0:
            raise ValueError(f"malloc of {nbytes} bytes: size must be positive")
        block_id = self._next_id
        arena = self._arena
        offset = arena.take(nbytes, block_id) if arena is not None else None
        if offset is None:
            offset = self._place(nbytes)
            if offset is None:
                raise self._exceeded(nbytes)
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

    def _place(self, nbytes: int) -> int | None:
        """The allocation step: an offset for `nbytes`, or None when it does not fit."""
        return self._fit.allocate(nbytes)

    def free(self, block: Block) -> None:
        """Return a live block's bytes; InvalidBlock (state untouched) for a foreign or dead one."""
        if block.session != self._session:
            raise InvalidBlock(f"{_describe(block)} belongs to another session")
        live = self._blocks.get(block.id)
        if live is None or (live is not block and live != block):
            raise InvalidBlock(f"{_describe(block)} is not live (already freed?)")
        self._unplace(block.id, block.offset)
        del self._blocks[block.id]
        self._frees += 1
        self._live_bytes -= block.size
        if self._record is not None:
            self._record(FREE, block.id, 0)

    def _unplace(self, block_id: int, offset: int) -> None:
        """The release step, inverse of `_place`: a block's bytes back to the arena or the fit."""
        arena = self._arena
        if arena is None or not arena.release(block_id):
            self._fit.release(offset)
        elif not arena.active and not arena.live:
            self._drop_arena()

    # -- ops -------------------------------------------------------------------------------
    def begin_op(self, blocks: Sequence[Block]) -> list[int]:
        """An op is about to access `blocks`: their lease offsets (here, where they were put)."""
        return [b.offset for b in blocks]

    def end_op(self, blocks: Sequence[Block]) -> None:
        """The op that `begin_op` announced has finished (nothing to do without swapping)."""

    def pin(self, block: Block) -> None:
        """Keep the block at its offset for good (it always is, without swapping)."""

    def close(self) -> None:
        """Release what the executor holds besides the lease (nothing, without swapping)."""

    # -- planned mode --------------------------------------------------------------------
    def install_plan(self, table: PlanTable) -> None:
        """Use this plan from the next `begin_iteration()` on (when its arena fits)."""
        self._pending = table

    def begin_iteration(self) -> None:
        """An iteration boundary: judge the plan in use, switch to a pending one, reset counts."""
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
        if self._pending is not None and (self._arena is None or not self._arena.live):
            if self._arena is not None:
                self._drop_arena()
            base = self._fit.allocate(self._pending.height) if self._pending.height else 0
            if base is not None:  # no room for the arena now: stay learning, try next time
                self._arena = Arena(self._pending, base)
                self._pending = None
        if self._arena is not None:
            self._arena.begin_iteration()
        self.last_footprint = self._high_water
        self._high_water = max((b.offset + b.size for b in self._blocks.values()), default=0)
        if self._arena is not None:
            self._high_water = max(self._high_water, self._arena.base + self._arena.table.height)

    def _drop_arena(self) -> None:
        arena = self._arena
        assert arena is not None and not arena.live
        if arena.table.height:
            self._fit.release(arena.base)
        self.plan_hits_before += arena.hits
        self.plan_misses_before += arena.misses
        self._arena = None

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
        asked = _size(nbytes) if rounded == nbytes else f"{_size(nbytes)}, {rounded} aligned"
        lease = _size(fit.capacity)
        if rounded > fit.capacity:
            return LeaseExceeded(f"malloc of {asked} exceeds the lease of {lease}")
        return LeaseExceeded(
            f"malloc of {asked} does not fit now: {_size(self._live_bytes)} live"
            f" in a lease of {lease}, largest free range {_size(fit.largest_free)}"
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
        """Sum of the rounded sizes of the live blocks."""
        return self._fit.used_bytes

    @property
    def free_bytes(self) -> int:
        return self._fit.free_bytes

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
