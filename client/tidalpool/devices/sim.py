"""Mapping a sim lease: a range of a memfd segment, mapped shared into this process.

Arrays point into the mapping by address. When the session ends while arrays
still exist, `retire()` swaps the range for private anonymous memory at the
same address: stale arrays then read zeros and can never reach memory the pool
has since leased to another session, and nothing crashes.
"""

from __future__ import annotations

import ctypes
import mmap
import os

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value


class SimMapping:
    """`length` bytes of segment `fd` from `offset`, at `address` in this process."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.length = length
        self._mm = mmap.mmap(
            fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
        )
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(anchor)
        del anchor  # no buffer export outlives this line
        self.retired = False

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """The bytes [offset, offset+nbytes) of the lease (tests and copies)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise ValueError(f"range {offset}+{nbytes} is outside the lease of {self.length} bytes")
        return memoryview(self._mm)[offset : offset + nbytes]

    def retire(self) -> None:
        """Replace the shared pages with private zero pages at the same address."""
        if self.retired:
            return
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
        got = _LIBC.mmap(self.address, self.length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if got == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot retire the lease mapping: {os.strerror(err)}")
        self.retired = True
