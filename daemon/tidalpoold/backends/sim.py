"""The sim backend: device and host pools are chunks of memfds, no GPU needed.

Every chunk is a sparse memfd (backends/memfd.py): a 4 GiB "device" costs nothing until
clients touch it. A client receives the fds of its own chunks only and maps them into one
contiguous range, exactly as a CUDA VMM client imports and maps its exported chunks.

At start it measures its copy bandwidth, as the cuda backend probes PCIe. A sim client's swap
copy is a `ctypes.memmove` between its device and host mappings on a stream's worker thread
(`tidalclient.devices.streams`), so that is what is timed, each way, and reported as the facts
`h2d_gbps` and `d2h_gbps` that unthrottled sessions are planned at:

    device chunks 0..k  ◀── memmove on a worker thread ──▶  host chunks 0..k   (k: the span)
    warm-up each way (faults the pages in), then h2d, d2h, h2d, d2h, ... each copy timed

Memory speed on a shared machine jumps from copy to copy (another process, a preempted
thread), so each way reports the median copy's rate, rounded to two significant figures: a
plan is cached per bandwidth (`plan_cache.key`), and a restart should find the plans of the
last run, not a key that differs in the third digit. The rounding moves the figure by at most
5% (half a step at 1.0 GB/s; 0.6% at 8.5), less than run-to-run noise.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import statistics
import threading
import time

from tidalcore.chunks import ChunkMapping

from tidalpoold.backends.bandwidth import (
    NOT_MEASURED,
    PROBE_BYTES,
    Bandwidth,
    gbps,
    repeats_for,
    significant,
)
from tidalpoold.backends.base import Chunk, Pool
from tidalpoold.backends.memfd import (
    close_chunks,
    memfd_chunk,
    memfd_chunks,
    resident_bytes,
    scrub_chunk,
)

_MiB = 1024 * 1024
PROBE_TOTAL = 256 * _MiB  # bytes timed each way: ~30 ms at memmove speed, start-up stays short
PROBE_REPEATS = 5  # timed copies each way at least, for a median


def probe_copies(device: Pool, host: Pool, span: int, total: int) -> Bandwidth:
    """Time copies of `span` bytes between the first chunks of `host` and `device`, mapped as a
    client maps its lease: one untimed warm-up copy each way, then at least `PROBE_REPEATS`
    (and `total` bytes) timed copies each way. Each way is the median copy's rate to two
    significant figures. The probed chunks' pages are given back afterwards, so the pools stay
    sparse and read as zeros."""
    if not 0 < span <= min(device.total, host.total):
        raise ValueError(f"probe span of {span} bytes for pools of {device.total}, {host.total}")
    repeats = repeats_for(span, total, least=PROBE_REPEATS)
    with contextlib.ExitStack() as undo:
        maps = []
        for pool in (device, host):
            chunks = pool.chunks[: -(-span // pool.chunk_bytes)]
            for chunk in chunks:
                undo.callback(scrub_chunk, chunk)  # runs after the unmapping below
            maps.append(ChunkMapping([c.fd for c in chunks], pool.chunk_bytes))
            undo.callback(maps[-1].close)
        dev, hst = (m.address for m in maps)
        times = time_copies({"h2d": (dev, hst), "d2h": (hst, dev)}, span, repeats)
    h2d, d2h = (gbps(span, statistics.median(times[way]) / 1e6) for way in ("h2d", "d2h"))
    return Bandwidth(significant(h2d), significant(d2h), span * repeats)


def time_copies(
    ways: dict[str, tuple[int, int]], nbytes: int, repeats: int
) -> dict[str, list[int]]:
    """On a worker thread, as a sim stream copies: `ctypes.memmove(dst, src, nbytes)` once
    untimed for each way (`ways`: name → (dst, src)), then `repeats` rounds of one timed copy
    each way. The nanoseconds of each timed copy, by way."""
    times: dict[str, list[int]] = {way: [] for way in ways}
    failed: list[BaseException] = []

    def copies() -> None:
        try:
            for dst, src in ways.values():  # warm-up: faults every page in
                ctypes.memmove(dst, src, nbytes)
            for _ in range(repeats):
                for way, (dst, src) in ways.items():
                    started = time.perf_counter_ns()
                    ctypes.memmove(dst, src, nbytes)
                    times[way].append(time.perf_counter_ns() - started)
        except BaseException as e:  # raised again on the calling thread
            failed.append(e)

    worker = threading.Thread(target=copies, name="tidalpool-probe")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return times


class SimBackend:
    """Both pools as memfd chunks. `probe_bytes` is the span of the copy-bandwidth probe (at
    most the smaller pool); 0 skips it, and the facts `h2d_gbps` and `d2h_gbps` are then 0.0
    (the planner's default bandwidth)."""

    name = "sim"
    mode = "memfd"
    mode_reason = "sim backend: every chunk of both pools is a memfd passed to its session only"
    pci_bus_id = ""

    def __init__(
        self,
        device_bytes: int,
        host_bytes: int,
        chunk_bytes: int,
        *,
        probe_bytes: int = PROBE_BYTES,
        probe_total: int = PROBE_TOTAL,
    ) -> None:
        device = memfd_chunks("device", chunk_bytes, device_bytes // chunk_bytes)
        try:
            host = memfd_chunks("host", chunk_bytes, host_bytes // chunk_bytes)
        except OSError:
            close_chunks(device)
            raise
        self.device = Pool("device", chunk_bytes, device)
        self.host = Pool("host", chunk_bytes, host)
        self._lock = threading.Lock()
        self.bandwidth = NOT_MEASURED
        span = min(probe_bytes, self.device.total, self.host.total)
        if span > 0:
            try:
                self.bandwidth = probe_copies(self.device, self.host, span, probe_total)
            except BaseException:
                self.close()
                raise

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
            close_chunks([old])  # under the lock: `facts` never reads a closed (or reused) fd

    def facts(self) -> dict[str, str | int | float]:
        with self._lock:  # a scrub closes the fd of the chunk it replaces
            resident = sum(resident_bytes(c) for c in self.device.chunks)
        return {
            "device": "sim (memfd chunks)",
            "total_bytes": self.device.total,
            "free_bytes": self.device.total - resident,
            "resident_bytes": resident,  # pages behind the device chunks now
            "chunk_bytes": self.device.chunk_bytes,
            "h2d_gbps": self.bandwidth.h2d_gbps,  # memmove host → device mapping; 0.0: skipped
            "d2h_gbps": self.bandwidth.d2h_gbps,
        }

    def close(self) -> None:
        close_chunks(self.device.chunks)
        close_chunks(self.host.chunks)
