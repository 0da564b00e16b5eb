"""Mapping memfd chunks (a sim lease, or any host lease): side by side in one range this process
reserves, page-locked for a GPU where asked.

    reserve   base ─▶ |.............. PROT_NONE ..............|   (anonymous, lease length)
    map       base ─▶ | chunk fd 0 | chunk fd 1 | chunk fd 2 |   (MAP_SHARED | MAP_FIXED)

Chunk k of the lease lands at base + k * chunk_bytes, so the executor sees one contiguous
lease although the chunks are scattered in the pool. The process holds no fd of any other
chunk: it can reach no other session's memory.

Arrays point into the mapping by address. When the session ends while arrays still exist,
`retire()` swaps the range for private anonymous memory at the same address: they can never
reach a chunk the pool has since leased to another session, and nothing crashes. The session
copies the bytes of the arrays still alive into that memory (`Session.close`): an array reads
its own data until the job lets go of it, never zeros in its place.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence

from tidalcore.cuda_driver import Driver

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
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _mmap(
    address: int | None, length: int, prot: int, flags: int, fd: int, what: str, offset: int = 0
) -> int:
    got = _LIBC.mmap(address, length, prot, flags, fd, offset)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot {what}: {os.strerror(err)}")
    return int(got)


# -- address-space helpers shared with the client's page spaces (tidalclient.devices.pages) ----


def reserve(length: int, alignment: int) -> int:
    """`length` bytes of PROT_NONE address space starting at a multiple of `alignment` (a
    multiple of the OS page): over-reserve by `alignment`, then unmap both ends."""
    anonymous = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    base = _mmap(None, length + alignment, _PROT_NONE, anonymous, -1, "reserve address space")
    start = -(-base // alignment) * alignment
    if start > base:
        _LIBC.munmap(base, start - base)
    end = base + length + alignment
    if end > start + length:
        _LIBC.munmap(start + length, end - start - length)
    return start


def map_shared(address: int, length: int, fd: int, offset: int, what: str) -> None:
    """Map bytes [offset, offset+length) of `fd` read/write and shared at `address`, replacing
    whatever was mapped there (MAP_FIXED)."""
    _mmap(address, length, _RW, mmap.MAP_SHARED | _MAP_FIXED, fd, what, offset)


def map_none(address: int, length: int, what: str) -> None:
    """Replace [address, address+length) with PROT_NONE anonymous memory: the range stays
    reserved and any access to it faults."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
    _mmap(address, length, _PROT_NONE, flags, -1, what)


def map_zero(address: int, length: int, what: str) -> None:
    """Replace [address, address+length) with private zero pages (read/write)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
    _mmap(address, length, _RW, flags, -1, what)


def unmap(address: int, length: int) -> None:
    """munmap [address, address+length)."""
    if _LIBC.munmap(address, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot unmap {length} bytes at {address:#x}: {os.strerror(err)}")


class ChunkMapping:
    """The chunks `fds` (each `chunk_bytes`), mapped in order from `address` in this process.
    The fds stay the caller's: close them after mapping (the mapping keeps the memory). Any
    memfd-chunk lease maps this way: the cuda host lease is one, page-locked on top."""

    def __init__(self, fds: Sequence[int], chunk_bytes: int) -> None:
        if not fds or chunk_bytes <= 0:
            raise ValueError(f"a lease of {len(fds)} chunks of {chunk_bytes} bytes maps nothing")
        self.length = len(fds) * chunk_bytes
        self.chunk_bytes = chunk_bytes
        anonymous = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self.address = _mmap(None, self.length, _PROT_NONE, anonymous, -1, "reserve the lease")
        try:
            for k, fd in enumerate(fds):
                at = self.address + k * chunk_bytes
                _mmap(at, chunk_bytes, _RW, mmap.MAP_SHARED | _MAP_FIXED, fd, f"map chunk {k}")
        except OSError:
            _LIBC.munmap(self.address, self.length)
            raise
        self._view = memoryview((ctypes.c_char * self.length).from_address(self.address)).cast("B")
        self.retired = False

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """The bytes [offset, offset+nbytes) of the lease (tests and copies)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise ValueError(f"range {offset}+{nbytes} is outside the lease of {self.length} bytes")
        return self._view[offset : offset + nbytes]

    def read(self, offset: int, nbytes: int) -> bytes:
        """A copy of the bytes [offset, offset+nbytes) of the lease."""
        return bytes(self.buffer(offset, nbytes))

    def retire(self, keep: Sequence[tuple[int, bytes]] = ()) -> None:
        """Replace the shared chunks with private zero pages at the same address, and put the
        bytes of `keep`, (offset in the lease, bytes), back into them: what the process still
        holds stays its own, never zeros (read them before the daemon scrubs the chunks)."""
        if self.retired:
            return
        for offset, data in keep:
            self.buffer(offset, len(data))  # bounds, before anything changes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
        _mmap(self.address, self.length, _RW, flags, -1, "retire the lease mapping")
        self.retired = True
        for offset, data in keep:
            ctypes.memmove(self.address + offset, data, len(data))

    def close(self) -> None:
        """Unmap the range (only when no pointer into it is left)."""
        if self.length:
            _LIBC.munmap(self.address, self.length)
            self.length = 0
            self.retired = True


class PinnedChunkMapping(ChunkMapping):
    """A host lease: the memfd chunks `fds`, contiguous at `address` (as on sim), page-locked.

    `retire()` unregisters the range and swaps it for private zero pages at the same address,
    as the sim mapping does.
    """

    def __init__(
        self, driver: Driver | None, fds: Sequence[int], chunk_bytes: int, register: bool = True
    ) -> None:
        if chunk_bytes % mmap.PAGESIZE:
            raise ValueError(f"chunk of {chunk_bytes} bytes is not a multiple of the page size")
        super().__init__(fds, chunk_bytes)
        self._driver = driver
        self.registered = False
        if register and driver is not None:
            try:
                driver.host_register(self.address, self.length)
            except BaseException:
                super().close()
                raise
            self.registered = True

    def zero(self, offset: int, nbytes: int) -> None:
        self.buffer(offset, nbytes)  # bounds
        ctypes.memset(self.address + offset, 0, nbytes)

    def _unregister(self) -> None:
        if self.registered and self._driver is not None:
            self.registered = False
            self._driver.host_unregister(self.address)

    def retire(self, keep: Sequence[tuple[int, bytes]] = ()) -> None:
        if self.retired:
            return
        self._unregister()
        super().retire(keep)

    def close(self) -> None:
        """Unregister and unmap (only when no pointer into the range is left)."""
        self._unregister()
        super().close()
