"""Online best-fit over a range: how blocks are placed while the daemon is still learning.

Every allocation is placed online by `BestFit`:
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

The module is pure: no I/O, no threads, no clock. "Does not fit" is None, not an exception.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from tidalcore.units import ALIGNMENT


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
