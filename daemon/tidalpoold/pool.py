"""Accounting of one preallocated pool: which chunks are leased to which session.

A pool is `count` chunks of `chunk_bytes`. A lease of n bytes takes ceil(n / chunk_bytes)
chunks, the lowest-numbered free ones; they need not be adjacent, since the client maps them
side by side into one range of its own. Returned chunks are free again at once.

    chunk   0    1    2    3    4    5
           |a   |b   |a   |    |b   |    |     lease a = (0, 2), lease b = (1, 4)

A pool in cuda "ipc" mode is one legacy IPC allocation, which a client cannot remap: there a
lease takes the lowest run of consecutive free chunks, and the client uses it at an offset.

    chunk   0    1    2    3    4    5
           |a   |    |a   |    |    |    |     consecutive: a lease of 3 takes (3, 4, 5)

Pure bookkeeping: no memory is touched here, no locks are taken (the session
registry serializes calls).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tidalcore.units import Bytes, format_size


class PoolExhausted(Exception):
    """Not enough free chunks in the pool for a lease."""


@dataclass(frozen=True, slots=True)
class Lease:
    """The chunks of one pool that a session holds, in the order the client maps them."""

    chunks: tuple[int, ...]
    chunk_bytes: int

    @property
    def length(self) -> Bytes:
        return Bytes(len(self.chunks) * self.chunk_bytes)


class PoolAccount:
    """Free and leased chunks of one pool; with `consecutive`, every lease is a run of
    consecutive chunks in ascending order."""

    def __init__(self, name: str, chunk_bytes: int, count: int, consecutive: bool = False) -> None:
        if chunk_bytes <= 0 or count < 0:
            raise ValueError(f"{name} pool of {count} chunks of {chunk_bytes} bytes is not a pool")
        self.name = name
        self.chunk_bytes = chunk_bytes
        self.count = count
        self.consecutive = consecutive
        self._free: list[int] = list(range(count))  # sorted
        self._leased: set[int] = set()

    @property
    def total(self) -> Bytes:
        return Bytes(self.count * self.chunk_bytes)

    @property
    def leased_bytes(self) -> Bytes:
        return Bytes(len(self._leased) * self.chunk_bytes)

    @property
    def free_bytes(self) -> Bytes:
        return Bytes(len(self._free) * self.chunk_bytes)

    @property
    def free_chunks(self) -> int:
        return len(self._free)

    def chunks_for(self, nbytes: int) -> int:
        """Chunks a lease of `nbytes` takes."""
        return -(-nbytes // self.chunk_bytes)

    def lease(self, nbytes: int) -> Lease:
        """Take the lowest free chunks that hold `nbytes`."""
        if nbytes <= 0:
            raise ValueError(f"{self.name} lease of {nbytes} bytes: size must be positive")
        n = self.chunks_for(nbytes)
        if n > len(self._free):
            raise PoolExhausted(
                f"{self.name} pool cannot lease {n} chunks ({format_size(n * self.chunk_bytes)})"
                f" for {nbytes} bytes: {len(self._free)} of {self.count} chunks of "
                f"{format_size(self.chunk_bytes)} free"
            )
        start = self._run(n) if self.consecutive else 0
        if start < 0:
            raise PoolExhausted(
                f"{self.name} pool has no {n} consecutive free chunks"
                f" ({format_size(n * self.chunk_bytes)}) for {nbytes} bytes, as a lease in ipc"
                f" mode needs: {len(self._free)} of {self.count} chunks of"
                f" {format_size(self.chunk_bytes)} free, but not side by side"
            )
        taken = tuple(self._free[start : start + n])
        del self._free[start : start + n]
        self._leased.update(taken)
        return Lease(taken, self.chunk_bytes)

    def _run(self, n: int) -> int:
        """Where in the free list the lowest run of `n` consecutive chunks starts, or -1."""
        free = self._free
        for i in range(len(free) - n + 1):
            if free[i + n - 1] - free[i] == n - 1:  # sorted and distinct: a run
                return i
        return -1

    def release(self, lease: Lease) -> None:
        """Return the chunks taken by lease()."""
        if lease.chunk_bytes != self.chunk_bytes or not self._leased.issuperset(lease.chunks):
            raise KeyError(f"{self.name} pool has not leased chunks {list(lease.chunks)}")
        if len(set(lease.chunks)) != len(lease.chunks):
            raise KeyError(f"{self.name} lease names a chunk twice: {list(lease.chunks)}")
        self._leased.difference_update(lease.chunks)
        for index in lease.chunks:
            bisect.insort(self._free, index)
