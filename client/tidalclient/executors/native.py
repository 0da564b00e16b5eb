"""A session's executor when a framework allocates through the native hot path (planned mode).

The framework (PyTorch's pluggable allocator) calls `tidalpool_alloc`/`tidalpool_free` in C;
nothing in Python runs per allocation. This class does, per batch or per iteration, what the
Python `Executor` does per call:

    framework ──alloc/free──▶ hotpath.so ──ring──▶ pull() ──forward──▶ Recorder ──▶ daemon
    session.step() ──▶ step() (the ITER event travels through the ring, in order)
    daemon's plan ──▶ Session ──▶ install_plan() ──▶ native plan table
    session stats and heartbeats ◀── the native counters

`pull` runs on the recorder's thread before each of its drains (every few milliseconds), so the
trace reaches the daemon as the Python executor's does. Python code allocates here through the
same hot path (`malloc`, `try_malloc`, `free`): its blocks are in the same table and the same
trace, with the ids the ring gives them. Nothing moves: a native session has no swap limit, so
it has no `Residency`.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
from tidalcore.units import ALIGNMENT, BlockId, Bytes, Offset

from tidalclient.errors import InvalidBlock, LeaseExceeded
from tidalclient.executors.base import (
    Block,
    ExecutorStats,
    check_size,
    describe,
    executor_ids,
    size_text,
)
from tidalclient.hotpath import EVENT_DTYPE, HotPath, NativeError, NativeStats, forward
from tidalclient.plans import Plan, PlanRejected, PlanTable
from tidalclient.recorder import Recorder

log = logging.getLogger("tidalpool")

DRAIN_BATCH = 1 << 16
"""Events moved out of the ring per native call."""


_serving: set[int] = set()  # native device indices configured for a live session
_serving_lock = threading.Lock()


class NativeExecutor:
    """The native hot path of one device, serving a session's lease."""

    def __init__(
        self,
        hotpath: HotPath,
        base: int,
        capacity: int,
        *,
        ring_events: int = 1 << 20,
        max_iteration_misses: int = 8,
        timestamps: bool = False,  # the recorder does not send event times: skip the clock
    ) -> None:
        with _serving_lock:
            if hotpath.device in _serving:
                raise NativeError(
                    f"native device {hotpath.device} already serves another session of this"
                    " process: close it first"
                )
            _serving.add(hotpath.device)
        try:
            hotpath.configure(
                base,
                capacity,
                alignment=ALIGNMENT,
                ring_events=ring_events,
                max_iteration_misses=max_iteration_misses,
                timestamps=timestamps,
            )
        except BaseException:
            with _serving_lock:
                _serving.discard(hotpath.device)
            raise
        self.hotpath = hotpath
        self._base = base
        self._session = next(executor_ids)
        self._capacity = capacity & ~(ALIGNMENT - 1)
        self._recorder: Recorder | None = None
        self._lock = threading.Lock()  # one puller at a time, events forwarded in order
        self._buffer = np.empty(DRAIN_BATCH, dtype=EVENT_DTYPE)
        self._closed = False
        self._final: NativeStats | None = None  # the counters when the session ended
        self._warned_overflow = False
        self._installed = False  # a plan was handed to the table

    def connect(self, recorder: Recorder) -> None:
        """Send the trace to `recorder`: its thread pulls the ring before each of its drains."""
        self._recorder = recorder
        recorder.source = self.pull

    # -- trace -------------------------------------------------------------------------
    def pull(self) -> int:
        """Forward every event in the ring to the recorder; how many."""
        total = 0
        with self._lock:
            recorder = self._recorder
            if self._closed or recorder is None:
                return 0
            while True:
                try:
                    n = self.hotpath.drain_into(self._buffer)
                except NativeError as e:  # the lease was reset under us: nothing more to read
                    log.warning("tidalpool: cannot drain the native trace ring: %s", e)
                    break
                forward(self._buffer[:n], recorder)
                total += n
                if n < len(self._buffer):
                    break
            if not self._warned_overflow and total and self.hotpath.stats().overflow:
                self._warned_overflow = True
                log.warning(
                    "tidalpool: the native trace ring overflowed (events lost; the daemon may"
                    " learn a wrong iteration): raise ring_events"
                )
        return total

    # -- iterations and plans ----------------------------------------------------------
    def step(self) -> int:
        """An iteration boundary; the new iteration number (its ITER event goes through the
        ring, in order with the framework's allocations)."""
        return self.hotpath.step()

    def install_plan(self, plan: Plan | None) -> None:
        """Hand a plan's placement to the native table (it takes over at a later step);
        PlanRejected when it does not suit the lease, or when it swaps or recomputes: the
        framework holds its tensors' addresses, so the allocator executes a placement and
        nothing else, and a plan is executed whole or not at all (docs/native.md). None: a
        plan of no slots, so every allocation is placed online (and counted a miss, which
        abandons it at the step after `max_misses`: learning), where a plan was handed before."""
        if plan is None:
            if self._installed:
                self.hotpath.install_plan(PlanTable.build(0, [], [], 0, self.alignment))
            return
        if plan.swaps or plan.recomputes:
            raise PlanRejected(
                f"plan {plan.plan_id} swaps or recomputes blocks, which the native allocator"
                " cannot do (a native session has no swap limit)"
            )
        self.hotpath.install_plan(plan.table)
        self._installed = True

    # -- blocks Python code allocates: through the same hot path as the framework's ------
    def malloc(self, nbytes: int) -> Block:
        """A new live block of `nbytes` from the native table (a plan's slot or best-fit, as
        the framework's allocations); LeaseExceeded when it does not fit now."""
        block = self.try_malloc(nbytes)
        if block is None:
            native = self.native_stats()
            raise LeaseExceeded(
                f"malloc of {size_text(nbytes)} does not fit now: {size_text(native.live_bytes)}"
                f" live in a lease of {size_text(self._capacity)}, largest free range"
                f" {size_text(native.largest_free)}"
            )
        return block

    def try_malloc(self, nbytes: int) -> Block | None:
        """A new live block of `nbytes`, or None when it does not fit now. Its id is the one
        the trace gives it (its ALLOC event travels through the ring, in order with the
        framework's)."""
        nbytes = check_size(nbytes)
        address = self.hotpath.alloc(nbytes)
        if address is None:
            return None
        block_id = self.hotpath.block_id(address)
        return Block(BlockId(block_id), Offset(address - self._base), Bytes(nbytes), self._session)

    def free(self, block: Block) -> None:
        """Return a block Python code allocated; InvalidBlock when it is not live here."""
        self._own(block)
        self.hotpath.free(self._base + block.offset)

    def offset(self, block: Block) -> int:
        """The block's lease offset: where it was put, for its life (nothing moves here)."""
        self._own(block)
        return block.offset

    def _own(self, block: Block) -> None:
        if block.session != self._session:
            raise InvalidBlock(f"{describe(block)} belongs to another session")

    # -- the end -----------------------------------------------------------------------
    def close(self) -> None:
        """Forget the lease in the native library: pointers freed later are ignored (counted
        as bad frees), and allocations return NULL until a new session configures it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._recorder is not None:
                self._recorder.source = None
            self._final = self.hotpath.stats()
            self.hotpath.reset()
            with _serving_lock:
                _serving.discard(self.hotpath.device)

    # -- views -------------------------------------------------------------------------
    def native_stats(self) -> NativeStats:
        """The hot path's counters (as they were when the session ended, once it has)."""
        return self._final if self._final is not None else self.hotpath.stats()

    def stats(self) -> ExecutorStats:
        native = self.native_stats()
        return ExecutorStats(
            live_bytes=native.live_bytes,
            peak_live_bytes=native.peak_live_bytes,
            used_bytes=native.used_bytes,
            live_blocks=native.live_blocks,
            mallocs=native.mallocs,
            frees=native.frees,
            mode="planned" if native.planned else "learning",
            plan_hits=native.hits,
            plan_misses=native.misses,
            high_water=self.high_water,
            native=native,
        )

    @property
    def session(self) -> int:
        """A process-unique id, as the Python executor's (no block carries it here)."""
        return self._session

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return ALIGNMENT

    @property
    def used_bytes(self) -> int:
        return self.native_stats().used_bytes

    @property
    def largest_free(self) -> int:
        return self.native_stats().largest_free

    @property
    def high_water(self) -> int:
        """The highest lease byte in use now (the native path keeps no per-iteration mark)."""
        if self._closed:
            return 0
        ranges = self.hotpath.free_ranges()
        if ranges and ranges[-1][0] + ranges[-1][1] >= self._capacity:
            return ranges[-1][0]
        return self._capacity
