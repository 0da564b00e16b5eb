"""Planned allocation: the daemon's placement for one iteration, ready for the hot path.

A plan lists, in allocation order, the size and offset of every allocation of
the steady iteration; offsets are relative to an *arena*, one range of the
lease reserved for the plan. Allocation i of an iteration takes slot i when its
size matches and no live block holds any slot whose bytes overlap slot i —
checked against the precomputed list of overlapping slots, so a hit costs
O(number of slots sharing those bytes). Anything else is a *miss*: the caller
allocates that block online, outside the arena, and nothing can overlap.

    lease:  | persistent (online) | arena: [slot bytes as planned] | online misses |
                                  ^ base

Pure: no I/O, no threads, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidalcore.units import align_up


class PlanRejected(ValueError):
    """A plan the client cannot use (inconsistent lengths, misaligned or out-of-range slots)."""


@dataclass(frozen=True, slots=True)
class PlanTable:
    plan_id: int
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    height: int
    overlaps: tuple[tuple[int, ...], ...]  # per slot: the other slots sharing any of its bytes

    @classmethod
    def build(
        cls, plan_id: int, sizes: list[int], offsets: list[int], height: int, alignment: int
    ) -> PlanTable:
        if len(sizes) != len(offsets):
            raise PlanRejected(f"plan {plan_id}: {len(sizes)} sizes but {len(offsets)} offsets")
        for i, (size, offset) in enumerate(zip(sizes, offsets, strict=True)):
            if size <= 0 or offset % alignment or offset + align_up(size, alignment) > height:
                raise PlanRejected(
                    f"plan {plan_id}: slot {i} ({size} bytes at offset {offset}) is empty, "
                    f"misaligned or beyond the plan's height {height}"
                )
        return cls(
            plan_id, tuple(sizes), tuple(offsets), height, _overlaps(sizes, offsets, alignment)
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
        self.occupant = [0] * len(table.sizes)  # block id holding each slot, 0 if none
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
        i = self.cursor
        self.cursor = i + 1
        table, occupant = self.table, self.occupant
        fits = i < len(table.sizes) and table.sizes[i] == nbytes and not occupant[i]
        if not fits or any(occupant[j] for j in table.overlaps[i]):
            self.misses += 1
            self.iteration_misses += 1
            return None
        occupant[i] = block_id
        self.slot_of[block_id] = i
        self.hits += 1
        return self.base + table.offsets[i]

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
