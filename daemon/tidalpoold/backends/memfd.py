"""Chunks as memfds: the sim backend's device pool, and the host pool of every backend.

Each chunk is its own sparse memfd (sized with ftruncate, never written here): pages are
backed only when a client touches them, and `punch_hole` gives them back to the kernel, so a
returned chunk really frees its memory and reads as zeros to its next holder. The chunk's
file name (`/memfd:tidalpool-POOL-INDEX`) shows in /proc/PID/maps of whoever maps it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterable

from tidalpoold.backends.base import Chunk

_LIBC = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def memfd_chunks(name: str, chunk_bytes: int, count: int) -> tuple[Chunk, ...]:
    """`count` sparse memfds of `chunk_bytes` each, named tidalpool-NAME-INDEX (CLOEXEC)."""
    if chunk_bytes <= 0 or count <= 0:
        raise ValueError(f"{name} pool: {count} chunks of {chunk_bytes} bytes is not a pool")
    chunks: list[Chunk] = []
    try:
        for index in range(count):
            chunks.append(memfd_chunk(name, index, chunk_bytes))
    except OSError:
        close_chunks(chunks)
        raise
    return tuple(chunks)


def memfd_chunk(name: str, index: int, chunk_bytes: int) -> Chunk:
    """One sparse memfd chunk, named tidalpool-NAME-INDEX (CLOEXEC)."""
    fd = os.memfd_create(f"tidalpool-{name}-{index}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, chunk_bytes)
    except OSError:
        os.close(fd)
        raise
    return Chunk(index, fd, chunk_bytes)


def close_chunks(chunks: Iterable[Chunk]) -> None:
    for chunk in chunks:
        if chunk.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(chunk.fd)


def scrub_chunk(chunk: Chunk) -> None:
    """Free every page of a memfd chunk: the memory is really free, the next holder reads zeros."""
    punch_hole(chunk.fd, 0, chunk.size)


def resident_bytes(chunk: Chunk) -> int:
    """Bytes of the chunk backed by memory now (its allocated blocks)."""
    return os.fstat(chunk.fd).st_blocks * 512


def punch_hole(fd: int, offset: int, length: int) -> None:
    mode = _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE
    rc = _LIBC.fallocate(
        ctypes.c_int(fd), ctypes.c_int(mode), ctypes.c_long(offset), ctypes.c_long(length)
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE) failed: {os.strerror(err)}")
