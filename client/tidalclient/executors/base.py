"""What every executor is: the one interface a Session holds, the one its residency adds under
a limit, and the values executors share.

    Session ──▶ Executor (this protocol: blocks and plans)
                 ├── PythonExecutor            blocks placed in Python: best-fit, or a plan's arena
                 ├── NativeExecutor            blocks placed by the C hot path (a framework's
                 │                             allocator, and Python code's through the same path)
                 ├── Swapping(PythonExecutor)  an adaptor: the inner executor's blocks may wait
                 │                             in the host lease while no op needs them
                 └── Paged                     blocks at addresses for life, pages moving beneath
                                               them (virtual residency)
    Session.residency ──▶ Residency (only under a swap limit: Swapping, Paged; else None)

An executor allocates, frees, says where a block's bytes are, runs iterations and takes plans;
each kind does all of it. What only a session under a limit has (blocks that leave the device
and come back, pins that keep them there, ops that bring them in) is the `Residency` protocol,
which NumPy, CuPy, torch and replay reach through `Session.residency` and nowhere else: no
executor implements a part of it as a refusal or a no-op. An adaptor stacks over an executor
as RMM's resource adaptors stack over a resource: `Swapping` calls its `PythonExecutor` for
blocks, and for the raw device bytes it moves blocks into and out of (`PythonExecutor.vacate`,
`reserve`, `release`: not part of either protocol).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tidalcore.units import BlockId, Bytes, Offset, format_size

from tidalclient.hotpath import NativeStats
from tidalclient.plans import Plan

if TYPE_CHECKING:
    from tidalclient.timeline import Timeline

DEVICE, LEAVING, HOST, ARRIVING = "device", "leaving", "host", "arriving"
"""Where a block is: on the device, being copied out, in the host lease, being copied in."""

executor_ids = itertools.count(1)  # ids of executors (Python and native) in this process


@dataclass(frozen=True, slots=True)
class Block:
    """A live allocation: where it was put in the lease, the size asked for, its owning executor."""

    id: BlockId
    offset: Offset
    size: Bytes
    session: int


@dataclass(frozen=True, slots=True)
class SwapStats:
    limit: int
    resident_bytes: int  # device bytes held: resident blocks and blocks copying out, rounded
    peak_resident_bytes: int
    swapped_out_bytes: int
    swapped_in_bytes: int
    swap_outs: int
    swap_ins: int
    stall_ns: int  # time ops and mallocs waited for copies
    scheduled_swaps: int  # swaps in the schedule in use (0: none, LRU only)
    schedule_skips: int  # scheduled swaps not applied (block gone, locked or pinned, or no room)
    host_used_bytes: int = 0  # host lease bytes holding swapped-out blocks
    # Of the bytes swapped each way: what a plan's schedule moved, and what the LRU cache moved
    # on demand (before a plan, after a miss); the two add up to swapped_*_bytes.
    planned_out_bytes: int = 0
    planned_in_bytes: int = 0
    on_demand_out_bytes: int = 0
    on_demand_in_bytes: int = 0
    piece_misses: int = 0  # scheduled swap-ins that could not land at their planned offset


@dataclass(frozen=True, slots=True)
class ExecutorStats:
    """What an executor has done: the counts a Session reports and its heartbeats carry."""

    live_bytes: int  # requested bytes of live blocks
    peak_live_bytes: int
    used_bytes: int  # device bytes held, rounded to the alignment
    live_blocks: int
    mallocs: int
    frees: int
    mode: str  # "learning" or "planned"
    plan_hits: int  # allocations served by a plan
    plan_misses: int  # allocations a plan could not serve (placed online)
    high_water: int  # highest lease byte used in the current iteration so far
    swap: SwapStats | None = None  # an executor that swaps
    native: NativeStats | None = None  # the native hot path's own counters


class Executor(Protocol):
    """Allocates a session's blocks in its device lease and runs its iterations.

    Blocks: `malloc` (LeaseExceeded when there is no room), `try_malloc` (None instead: the
    hot path's "does not fit" is a value), `free`, `offset` (where its bytes are now).
    Iterations: `step` marks a boundary (a plan installed by `install_plan` takes over at
    one; `install_plan(None)`: allocations are placed online again from one, as before any
    plan, for an iteration of a shape that has none) and returns the new iteration's number.
    """

    @property
    def session(self) -> int:
        """A process-unique id, carried by this executor's blocks as `Block.session`."""
        ...

    @property
    def capacity(self) -> int: ...

    @property
    def alignment(self) -> int: ...

    @property
    def used_bytes(self) -> int:
        """Device bytes held now (blocks, reservations, a plan's arena), rounded."""
        ...

    @property
    def largest_free(self) -> int:
        """The largest range of the lease that is free now."""
        ...

    def malloc(self, nbytes: int) -> Block: ...

    def try_malloc(self, nbytes: int) -> Block | None: ...

    def free(self, block: Block) -> None: ...

    def offset(self, block: Block) -> int: ...

    def step(self) -> int: ...

    def install_plan(self, plan: Plan | None) -> None: ...

    def stats(self) -> ExecutorStats: ...

    def close(self) -> None: ...


@runtime_checkable
class Switches(Protocol):
    """An executor that can take another plan for the iteration just begun, until its first
    allocation (`Session` recognising an iteration's shape from that allocation)."""

    def switch_plan(self, plan: Plan | None) -> None: ...


class Residency(Protocol):
    """Where a session's blocks are, under a swap limit: they may leave the device between
    the ops that use them.

    `pin` (never moves again), `where` (DEVICE, LEAVING, HOST or ARRIVING), `swap_out` (start
    moving it out now: False when it cannot leave), `prefetch` (start bringing it back). Ops:
    `begin_op` makes the blocks resident and returns their offsets, `end_op` ends the op; an
    op on no blocks still counts as one of the iteration's ops (a schedule is by op).
    """

    timeline: Timeline | None
    """Where its copies and the waits of the calling thread go as spans (None: nowhere)."""

    def pin(self, block: Block) -> None: ...

    def where(self, block: Block) -> str: ...

    def swap_out(self, block: Block) -> bool: ...

    def prefetch(self, block: Block) -> None: ...

    def begin_op(self, blocks: Sequence[Block]) -> list[int]: ...

    def end_op(self, blocks: Sequence[Block]) -> None: ...


def check_size(nbytes: int) -> int:
    """A malloc size as an int: TypeError for what is no integer (bools, floats, strings; NumPy
    integers are fine), ValueError for one that is not positive."""
    if type(nbytes) is not int:
        if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
            raise TypeError(f"malloc size must be an int, got {type(nbytes).__name__}")
        nbytes = operator.index(nbytes)
    if nbytes <= 0:
        raise ValueError(f"malloc of {nbytes} bytes: size must be positive")
    return nbytes


def size_text(nbytes: int) -> str:
    """'512 bytes' or '1.5 KiB (1536 bytes)': readable and exact."""
    return f"{nbytes} bytes" if nbytes < 1024 else f"{format_size(nbytes)} ({nbytes} bytes)"


def describe(block: Block) -> str:
    return f"block {block.id} (offset {block.offset}, {size_text(block.size)})"
