"""The daemon's half of a backend: it makes the two pools as chunks and exports each chunk.

A pool is `len(chunks)` chunks of `chunk_bytes` each. A lease is a set of chunk indices; the
client receives the fds of exactly those chunks and maps them, in lease order, into one
contiguous range it reserves:

    pool    | c0 | c1 | c2 | c3 | c4 | c5 |        (each chunk: its own fd)
    lease   {c4, c1}
    client  base ─▶ | c4 | c1 |                    (chunk k of the lease at base + k*chunk_bytes)

A session can reach no chunk it was not handed: isolation rests on the kernel (which fds a
process holds), not on the client library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Chunk:
    """One physical chunk of a pool, as something a client can map or import."""

    index: int  # 0..n-1 within its pool
    fd: int  # a memfd (sim device, every host pool) or a CUDA VMM export; -1 in cuda "ipc" mode
    size: int  # bytes; all chunks of a pool have the same size


@dataclass(frozen=True, slots=True)
class Pool:
    """A preallocated pool: `name` is "device" or "host"."""

    name: str
    chunk_bytes: int
    chunks: tuple[Chunk, ...]
    # cuda "ipc" fallback only: the legacy IPC handle of the one allocation; chunk i is at
    # offset i * chunk_bytes in it.
    ipc_handle: bytes = b""

    @property
    def total(self) -> int:
        return self.chunk_bytes * len(self.chunks)


class Backend(Protocol):
    name: str  # "sim" | "cuda"
    mode: str  # how device memory is shared: "memfd" (sim), "vmm" (cuda), "ipc" (no isolation)
    mode_reason: str  # one line for the start-up log saying why this mode
    pci_bus_id: str  # cuda: the GPU's PCI bus id, which the client opens by; "" on sim
    device: Pool
    host: Pool

    def scrub(self, pool: Pool, chunk: Chunk) -> None:
        """Free or zero the memory behind a returned chunk: its next holder reads zeros. A
        backend may renew the chunk as it does (a new fd at the same index, so that a client
        still mapping the old one cannot reach the next holder): callers read `device`/`host`
        afresh after a scrub."""
        ...

    def facts(self) -> dict[str, str | int | float]:
        """For logs and `tidalpool status`: at least "device", "total_bytes", "free_bytes"."""
        ...

    def close(self) -> None:
        """Release the pools (after every session has ended)."""
        ...
