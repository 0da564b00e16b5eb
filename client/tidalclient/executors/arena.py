"""A plan in use: which block holds which slot of the plan's arena, and the hit/miss counts.

Allocation i of an iteration takes slot i when its size matches and no live block holds any
slot whose bytes overlap slot i (checked against the slot's precomputed overlaps, so a hit
costs O(slots sharing those bytes)). Anything else is a *miss*: the executor places that block
online, outside the arena, and nothing can overlap.

    lease:  | persistent (online) | arena: [slot bytes as planned] | online misses |
                                  ^ base

Pure: no I/O, no threads, no clock.
"""

from __future__ import annotations

from tidalclient.plans import PlanTable


class Arena:
    """A plan in use: which block holds which slot, and the hit/miss counts."""

    __slots__ = (
        "active",
        "base",
        "cursor",
        "hits",
        "iteration_misses",
        "misses",
        "occupant",
        "slot_of",
        "table",
    )

    def __init__(self, table: PlanTable, base: int) -> None:
        self.table = table
        self.base = base
        self.occupant = [0] * len(table.overlaps)  # block id holding each slot, 0 if none
        self.slot_of: dict[int, int] = {}
        self.cursor = 0  # index of the next allocation within the iteration
        self.active = True  # False once abandoned: no new slots, live ones drain
        self.hits = 0
        self.misses = 0
        self.iteration_misses = 0

    def take(self, nbytes: int, block_id: int) -> int | None:
        """The lease offset for this allocation from the plan, or None (a miss)."""
        if not self.active:
            return None
        fits = self.would_take(nbytes)
        i = self.cursor
        self.cursor = i + 1
        if not fits:
            self.misses += 1
            self.iteration_misses += 1
            return None
        self.occupant[i] = block_id
        self.slot_of[block_id] = i
        self.hits += 1
        return self.base + self.table.offsets[i]

    def would_take(self, nbytes: int) -> bool:
        """Whether `take(nbytes, ...)` would give a slot now (no side effect)."""
        i, table = self.cursor, self.table
        return self.active and i < len(table.sizes) and table.sizes[i] == nbytes and self._free(i)

    def take_slot(self, slot: int, block_id: int) -> int | None:
        """The lease offset of a piece's slot (after the allocations') for `block_id`, or None
        while it or a slot sharing its bytes is held. Counts no hit or miss."""
        if not (self.active and self._free(slot)):
            return None
        self.occupant[slot] = block_id
        self.slot_of[block_id] = slot
        return self.base + self.table.pieces[slot - len(self.table.sizes)][1]

    def _free(self, slot: int) -> bool:
        """Neither the slot nor any slot sharing its bytes is held."""
        occupant = self.occupant
        return not occupant[slot] and not any(occupant[j] for j in self.table.overlaps[slot])

    def release(self, block_id: int) -> bool:
        """Free a block's slot; False if the block is not one of this arena's."""
        i = self.slot_of.pop(block_id, None)
        if i is None:
            return False
        self.occupant[i] = 0
        return True

    def begin_iteration(self) -> None:
        self.cursor = 0
        self.iteration_misses = 0

    @property
    def live(self) -> int:
        return len(self.slot_of)
