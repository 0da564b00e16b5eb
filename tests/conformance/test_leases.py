"""Leases and malloc/free, the same on every backend: whole chunks, mapped in lease order,
zeros for every new holder, every chunk back in the pool at the end."""

from __future__ import annotations

import numpy as np
import pytest
import tidalpool
from tidalclient import status
from tidalclient.local import LocalDaemon

from .conftest import CHUNK, block_bytes, mapped_files

MiB = 1 << 20


def leases(d: LocalDaemon) -> list[tuple[list[int], list[int]]]:
    _, sessions = status.fetch(d.socket_dir)
    return [(list(s.lease.device.chunks), list(s.lease.host.chunks)) for s in sessions.sessions]


def test_a_lease_is_whole_chunks_mapped_in_order(backend: str, pool_daemon: LocalDaemon) -> None:
    d = pool_daemon
    with tidalpool.attach(d.socket_dir, device_limit="5MiB", host_limit="1B") as s:
        pool, sessions = status.fetch(d.socket_dir)
        (info,) = sessions.sessions
        assert (pool.backend, info.lease.backend, pool.chunk_bytes) == (backend, backend, CHUNK)
        assert (list(info.lease.device.chunks), list(info.lease.host.chunks)) == ([0, 1, 2], [0])
        assert (s.device.length, s.host.length) == (3 * CHUNK, CHUNK)
        assert (pool.device.leased_bytes, pool.host.leased_bytes) == (3 * CHUNK, CHUNK)
        if info.lease.mode == "memfd":  # the kernel's view: chunk k of the lease at base + k*chunk
            names = [name for _, _, name in mapped_files(s.device.address, s.device.length)]
            assert names == [f"/memfd:tidalpool-device-{i} (deleted)" for i in (0, 1, 2)]
        # One block over the whole lease, across both chunk boundaries: every byte is its own.
        whole = s.malloc(s.device.length)
        view = block_bytes(s, whole)
        assert bytes(view) == bytes(3 * CHUNK)
        pattern = (np.arange(3 * CHUNK, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)
        view[:] = pattern.tobytes()
        assert bytes(view[CHUNK - 8 : CHUNK + 8]) == pattern[CHUNK - 8 : CHUNK + 8].tobytes()
        assert bytes(view) == pattern.tobytes()
        with pytest.raises(tidalpool.LeaseExceeded):
            s.malloc(256)
        s.free(whole)
        blocks = [s.malloc(n) for n in (1, 4096, CHUNK, CHUNK - 4097)]
        assert [b.offset for b in blocks] == [0, 256, 4352, 4352 + CHUNK]
        for b in blocks:
            s.free(b)
        assert (s.stats().live_blocks, s.stats().mallocs, s.stats().frees) == (0, 5, 5)
    pool, _ = status.fetch(d.socket_dir)
    assert (pool.device.leased_bytes, pool.host.leased_bytes, leases(d)) == (0, 0, [])


def test_lease_bytes_are_zeroed_between_sessions(backend: str, pool_daemon: LocalDaemon) -> None:
    d = pool_daemon
    with tidalpool.attach(d.socket_dir, device_limit="4MiB") as s:
        block = s.malloc(4 * MiB)
        block_bytes(s, block)[:] = b"\xab" * (4 * MiB)
        first = leases(d)[0][0]
    with tidalpool.attach(d.socket_dir, device_limit="4MiB") as s2:
        assert leases(d)[0][0] == first == [0, 1]  # the lowest free chunks, handed out again
        block = s2.malloc(4 * MiB)
        assert bytes(block_bytes(s2, block)) == bytes(4 * MiB)


def test_freed_chunks_are_reused_wherever_they_are(backend: str, pool_daemon: LocalDaemon) -> None:
    """Leases need not be contiguous in the pool: one freed between two others serves a lease
    that spans it and the free tail."""
    d = pool_daemon
    a = tidalpool.attach(d.socket_dir, device_limit="2MiB", host_limit="2MiB")
    b = tidalpool.attach(d.socket_dir, device_limit="2MiB", host_limit="2MiB")
    a.close()
    with tidalpool.attach(d.socket_dir, device_limit="4MiB", host_limit="2MiB") as c:
        assert sorted(leases(d)) == [([0, 2], [0]), ([1], [1])]
        whole = c.malloc(4 * MiB)
        view = block_bytes(c, whole)
        view[:] = bytes(range(256)) * (4 * MiB // 256)
        assert bytes(view) == bytes(range(256)) * (4 * MiB // 256)
    b.close()
