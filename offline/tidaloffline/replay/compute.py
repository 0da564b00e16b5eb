"""The replay's compute stream: each op's traced time, then the stamps of its blocks.

Every block an op reads is checked: a block written by an op carries a 64-byte stamp (its
replay serial and write count) at its start, middle and end; an op that reads it verifies the
stamps on the compute stream, after the op's compute, so a block that came back wrong, late or
from the wrong place counts as a mismatch (docs/replay.md says exactly what is checked).
`SimCompute` runs on the sim backend's stream thread, `CudaCompute` as CuPy kernels.
"""

from __future__ import annotations

import importlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tidalclient.timeline import COMPUTE_TRACK

from tidaloffline.replay.errors import ReplayError

if TYPE_CHECKING:
    from tidalclient.timeline import Timeline

STAMP = 64  # bytes of one stamp
_MAGIC = 0x7469_6461_6C70_6F6F
_WORDS = 0xFFFF_FFFF_FFFF_FFFF


def stamp(serial: int, writes: int, size: int) -> bytes:
    """The bytes a block of `size` bytes carries at each of its places after its `writes`-th
    write: eight little-endian words of its serial and write count (the first `size` bytes of
    them for a block under 64 bytes)."""
    base = ((serial & 0xFFFF_FFFF) << 32) | (writes & 0xFFFF_FFFF)
    words = [(base ^ (_MAGIC * (j + 1))) & _WORDS for j in range(STAMP // 8)]
    return struct.pack("<8Q", *words)[: min(size, STAMP)]


def places(size: int) -> tuple[int, ...]:
    """Where a block's stamps go: its first 64 bytes, its middle 64 when they touch neither
    end's, its last 64 when they are not its first.

        [stamp]........[stamp]........[stamp]      0, (size - 64) // 2, size - 64
    """
    out = [0]
    if size >= 3 * STAMP:
        out.append((size - STAMP) // 2)
    if size >= 2 * STAMP:
        out.append(size - STAMP)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Mark:
    """One block's stamps for an op: the view of it the op yields, its size, serial and
    write count (the count the stamps must show, or carry once written)."""

    view: Any  # sim: a uint8 NumPy array over its device bytes; cuda: its device address
    size: int
    serial: int
    writes: int


class Compute(Protocol):
    """Where the ops' work runs: in stream order, asynchronously to the training thread.
    With a `timeline`, each op is a span on its compute track."""

    timeline: Timeline | None

    def run(self, ns: int, reads: Sequence[Mark], writes: Sequence[Mark], name: str = "op") -> None:
        """Enqueue one op: `ns` of compute, then check the stamps of `reads`, then stamp
        `writes`."""
        ...

    def synchronize(self) -> None: ...

    def counts(self) -> tuple[int, int]:
        """(stamps found wrong, stamps checked) so far; call after `synchronize`."""
        ...


class SimCompute:
    """The sim backend's compute stream (a `Stream` worker thread): an op sleeps until its
    deadline, then checks and stamps through the NumPy views of the device bytes.

    As on a GPU, an op starts when it is runnable: once it was enqueued, the op before it
    ended, and the events the stream waited for since completed. Its deadline counts from
    then, not from when the worker thread woke up for it, so the thread's wake-up latency and
    the checks' time do not add up over back-to-back ops."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._wrong = 0
        self._checked = 0  # written by the stream's thread only; read after synchronize
        self._end = 0  # the deadline of the op before (perf_counter_ns)
        self.timeline: Timeline | None = None

    def run(self, ns: int, reads: Sequence[Mark], writes: Sequence[Mark], name: str = "op") -> None:
        queued = time.perf_counter_ns()
        timeline = self.timeline

        def work() -> None:
            start = max(queued, self._end, self._stream.ready_ns)
            self._end = end = start + ns
            while (left := end - time.perf_counter_ns()) > 0:
                time.sleep(left / 1e9)
            for m in reads:
                want = stamp(m.serial, m.writes, m.size)
                for p in places(m.size):
                    self._checked += 1
                    if m.view[p : p + len(want)].tobytes() != want:
                        self._wrong += 1
            for m in writes:
                got = stamp(m.serial, m.writes, m.size)
                for p in places(m.size):
                    m.view[p : p + len(got)] = memoryview(got)
            if timeline is not None:  # the op, its checks and stamps included
                timeline.span(COMPUTE_TRACK, name, start, time.perf_counter_ns())

        self._stream.launch(work)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def counts(self) -> tuple[int, int]:
        return self._wrong, self._checked


_KERNELS = r"""
#define STAMP 64
__device__ unsigned char stamp_byte(unsigned long long serial, unsigned long long writes, int i) {
  unsigned long long base = ((serial & 0xffffffffULL) << 32) | (writes & 0xffffffffULL);
  unsigned long long word = base ^ (0x746964616C706F6FULL * (unsigned long long)(i / 8 + 1));
  return (unsigned char)(word >> (8 * (i % 8)));
}
__device__ long long place(unsigned long long size, int k) {
  if (k == 0) return 0;
  if (k == 1) return size >= 3 * STAMP ? (long long)((size - STAMP) / 2) : -1;
  return size >= 2 * STAMP ? (long long)(size - STAMP) : -1;
}
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
extern "C" __global__ void stamp(unsigned long long address, unsigned long long size,
                                 unsigned long long serial, unsigned long long writes) {
  long long at = place(size, blockIdx.x);
  int i = threadIdx.x;
  if (at >= 0 && i < (size < STAMP ? (int)size : STAMP))
    ((unsigned char*)address)[at + i] = stamp_byte(serial, writes, i);
}
extern "C" __global__ void check(unsigned long long address, unsigned long long size,
                                 unsigned long long serial, unsigned long long writes,
                                 unsigned long long* counts) {
  long long at = place(size, blockIdx.x);
  int i = threadIdx.x;
  int bad = at >= 0 && i < (size < STAMP ? (int)size : STAMP)
            && ((const unsigned char*)address)[at + i] != stamp_byte(serial, writes, i);
  bad = __syncthreads_or(bad);
  if (i == 0 && at >= 0) {
    atomicAdd(&counts[1], 1ULL);
    if (bad) atomicAdd(&counts[0], 1ULL);
  }
}
"""


class CudaCompute:
    """The cuda backend's compute stream: an op is a kernel spinning on the GPU's global timer,
    then one kernel per stamp check (mismatches counted on the device) and per stamp write."""

    def __init__(self, stream: Any, ordinal: int) -> None:
        cupy = need_cupy()
        self._cp = cupy
        self._timed = stream  # a `CudaStream`: its timing events time the ops
        self.timeline: Timeline | None = None
        self._device = cupy.cuda.Device(ordinal)
        with self._device:
            self._stream = cupy.cuda.ExternalStream(int(stream.handle))
            module = cupy.RawModule(code=_KERNELS)
            self._spin = module.get_function("spin")
            self._stamp = module.get_function("stamp")
            self._check = module.get_function("check")
            self._counts = cupy.zeros(2, dtype=cupy.uint64)

    def run(self, ns: int, reads: Sequence[Mark], writes: Sequence[Mark], name: str = "op") -> None:
        u64 = self._cp.uint64
        timeline = self.timeline
        start = self._timed.timed() if timeline is not None else None
        with self._device, self._stream:
            self._spin((1,), (1,), (u64(ns),))
            for m in reads:
                args = (u64(m.view), u64(m.size), u64(m.serial), u64(m.writes), self._counts)
                self._check((3,), (STAMP,), args)
            for m in writes:
                self._stamp(
                    (3,), (STAMP,), (u64(m.view), u64(m.size), u64(m.serial), u64(m.writes))
                )
        if timeline is not None:
            timeline.device_span(COMPUTE_TRACK, name, start, self._timed.timed())

    def synchronize(self) -> None:
        self._stream.synchronize()

    def counts(self) -> tuple[int, int]:
        with self._device:
            wrong, checked = (int(x) for x in self._counts.get(stream=self._stream))
        return wrong, checked


def need_cupy() -> Any:
    """The cupy module, or ReplayError saying it is needed."""
    try:
        return importlib.import_module("cupy")
    except ImportError:
        raise ReplayError(
            "a cuda replay runs its ops as CuPy kernels: install CuPy (the cupy extra)"
        ) from None
