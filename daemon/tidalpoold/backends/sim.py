"""The sim backend: device and host pools are chunks of memfds, no GPU needed.

Every chunk is a sparse memfd (backends/memfd.py): a 4 GiB "device" costs nothing until
clients touch it. A client receives the fds of its own chunks only and maps them into one
contiguous range, exactly as a CUDA VMM client imports and maps its exported chunks.
"""

from __future__ import annotations

import dataclasses
import threading

from tidalpoold.backends.base import Chunk, Pool
from tidalpoold.backends.memfd import (
    close_chunks,
    memfd_chunk,
    memfd_chunks,
    resident_bytes,
    scrub_chunk,
)


class SimBackend:
    name = "sim"
    mode = "memfd"
    mode_reason = "sim backend: every chunk of both pools is a memfd passed to its session only"
    pci_bus_id = ""

    def __init__(self, device_bytes: int, host_bytes: int, chunk_bytes: int) -> None:
        device = memfd_chunks("device", chunk_bytes, device_bytes // chunk_bytes)
        try:
            host = memfd_chunks("host", chunk_bytes, host_bytes // chunk_bytes)
        except OSError:
            close_chunks(device)
            raise
        self.device = Pool("device", chunk_bytes, device)
        self.host = Pool("host", chunk_bytes, host)
        self._lock = threading.Lock()

    def scrub(self, pool: Pool, chunk: Chunk) -> None:
        """Give the chunk's pages back to the kernel and put a new memfd in its place: the
        memory is really free again, the next session to lease it reads zeros, and a client
        that still maps the old file (evicted, but alive) writes only into that orphan, never
        into the next holder's memory."""
        scrub_chunk(chunk)
        fresh = memfd_chunk(pool.name, chunk.index, chunk.size)
        with self._lock:  # sessions end on several threads: one replacement at a time
            current = self.device if pool.name == "device" else self.host
            chunks = list(current.chunks)
            old, chunks[chunk.index] = chunks[chunk.index], fresh
            renewed = dataclasses.replace(current, chunks=tuple(chunks))
            if pool.name == "device":
                self.device = renewed
            else:
                self.host = renewed
        close_chunks([old])

    def facts(self) -> dict[str, str | int | float]:
        resident = sum(resident_bytes(c) for c in self.device.chunks)
        return {
            "device": "sim (memfd chunks)",
            "total_bytes": self.device.total,
            "free_bytes": self.device.total - resident,
            "resident_bytes": resident,  # pages behind the device chunks now
            "chunk_bytes": self.device.chunk_bytes,
        }

    def close(self) -> None:
        close_chunks(self.device.chunks)
        close_chunks(self.host.chunks)
