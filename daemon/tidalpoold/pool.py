"""Accounting of one preallocated pool: which ranges are leased to which session.

A pool is one segment of `total` bytes. A lease is an aligned range of it,
chosen first-fit (leases are few and large; first-fit keeps them packed at the
low end). Released ranges merge with free neighbours.

    0                                                         total
    |== lease a ==|..... free .....|==== lease b ====|.. free ..|

Pure bookkeeping: no memory is touched here, no locks are taken (the session
registry serializes calls).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tidalpool.units import Bytes, Offset, align_up


class PoolExhausted(Exception):
    """No free range of the pool is large enough for a lease."""


@dataclass(frozen=True, slots=True)
class LeaseRange:
    offset: Offset
    length: Bytes


class PoolAccount:
    """Free and leased ranges of one pool segment."""

    def __init__(self, name: str, total: int, alignment: int) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"pool alignment must be a power of two, got {alignment}")
        self.name = name
        self.total = Bytes(total - total % alignment)
        self.alignment = alignment
        self._free: list[tuple[int, int]] = [(0, self.total)] if self.total else []
        self._leased: dict[int, int] = {}

    @property
    def leased_bytes(self) -> Bytes:
        return Bytes(sum(self._leased.values()))

    @property
    def free_bytes(self) -> Bytes:
        return Bytes(self.total - self.leased_bytes)

    @property
    def largest_free(self) -> Bytes:
        return Bytes(max((size for _, size in self._free), default=0))

    def lease(self, nbytes: int) -> LeaseRange:
        """Take an aligned range of at least `nbytes` (first fit)."""
        if nbytes <= 0:
            raise ValueError(f"{self.name} lease of {nbytes} bytes: size must be positive")
        length = align_up(nbytes, self.alignment)
        for i, (start, size) in enumerate(self._free):
            if size >= length:
                if size == length:
                    del self._free[i]
                else:
                    self._free[i] = (start + length, size - length)
                self._leased[start] = length
                return LeaseRange(Offset(start), Bytes(length))
        raise PoolExhausted(
            f"{self.name} pool cannot lease {length} bytes: {self.free_bytes} of "
            f"{self.total} bytes free, largest free range {self.largest_free} bytes"
        )

    def release(self, lease: LeaseRange) -> None:
        """Return a range taken by lease(); merges it with free neighbours."""
        if self._leased.get(lease.offset) != lease.length:
            raise KeyError(f"{self.name} pool has no lease at {lease.offset}+{lease.length}")
        del self._leased[lease.offset]
        start, size = int(lease.offset), int(lease.length)
        i = bisect.bisect_left(self._free, (start, 0))
        if i < len(self._free) and self._free[i][0] == start + size:
            size += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == start:
            start, prev = self._free.pop(i - 1)
            size += prev
            i -= 1
        self._free.insert(i, (start, size))
