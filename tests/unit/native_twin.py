"""The native hot path and the Python executor driven in lockstep, every decision compared.

`Twin` sends each malloc, free, step and plan to both a `HotPath` (lease at BASE, addresses) and
an `PythonExecutor` (offsets) and asserts after each call that they agree: the same offset or the
same failure, the same plan hits, misses and fallbacks, the same free ranges.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tidalclient.errors import LeaseExceeded
from tidalclient.executors.base import Block
from tidalclient.executors.python import PythonExecutor
from tidalclient.hotpath import HotPath, library_path
from tidalclient.plans import Plan, PlanTable

BASE = 1 << 40  # the lease's address: a number, never dereferenced


def check_built() -> None:
    """Fail (not skip) when a C source is newer than the built library: tests would run old code."""
    so = library_path()
    stale = [s.name for s in so.parent.glob("*.[ch]") if s.stat().st_mtime > so.stat().st_mtime]
    if stale:
        pytest.fail(f"{so.name} is older than {', '.join(stale)}: rebuild (pip install -e .)")


def fresh(device: int = 0) -> Iterator[HotPath]:
    """A fixture body: the device's state forgotten before and after the test."""
    check_built()
    hp = HotPath(device)
    hp.reset()
    yield hp
    hp.reset()


class Twin:
    def __init__(self, hp: HotPath, capacity: int, max_misses: int = 8) -> None:
        self.hp = hp
        self.ex = PythonExecutor(capacity)
        self.ex.max_iteration_misses = max_misses
        hp.configure(BASE, capacity, max_iteration_misses=max_misses)
        self.live: dict[int, tuple[Block, int]] = {}  # key -> (python block, native address)
        self.offsets: list[int | None] = []  # every malloc's offset (None: did not fit)

    def malloc(self, key: int, size: int) -> int | None:
        try:
            block: Block | None = self.ex.malloc(size)
        except LeaseExceeded:
            block = None
        address = self.hp.alloc(size)
        offset = None if address is None else address - BASE
        assert offset == (None if block is None else block.offset), f"malloc {key} of {size}"
        if block is not None and address is not None:
            self.live[key] = (block, address)
        self.offsets.append(offset)
        self.compare()
        return offset

    def free(self, key: int) -> None:
        block, address = self.live.pop(key)
        self.ex.free(block)
        self.hp.free(address)
        self.compare()

    def step(self) -> None:
        self.ex.step()
        self.hp.step()
        self.compare()

    def install(self, table: PlanTable) -> None:
        self.ex.install_plan(Plan(table))
        self.hp.install_plan(table)

    def compare(self) -> None:
        s, ex = self.hp.stats(), self.ex
        assert (s.hits, s.misses, s.fallbacks) == (ex.plan_hits, ex.plan_misses, ex.plan_fallbacks)
        assert s.planned == (ex.mode == "planned")
        assert (s.live_blocks, s.live_bytes) == (ex.live_blocks, ex.live_bytes)
        assert (s.used_bytes, s.peak_live_bytes) == (ex.used_bytes, ex.peak_live_bytes)
        assert s.free_ranges == len(ex.free_ranges())

    def compare_ranges(self) -> None:
        assert self.hp.free_ranges() == self.ex.free_ranges()


def trace_plan(path: Path) -> tuple[PlanTable, list[tuple[str, int, int]]]:
    """The daemon's plan for a trace's steady iteration, and the trace's alloc/free/iter events."""
    from tidaloffline.formats import read_trace_csv
    from tidalplan.learn import extract, to_problem
    from tidalplan.placement import solve

    events = read_trace_csv(path)
    iteration = extract(events, events.marks())
    problem, mapping = to_problem(iteration, alignment=256)
    placement = solve(problem, time_limit_s=5.0)
    sizes = [int(b.size) for b in iteration.blocks]
    offsets = [0] * len(sizes)
    for buffer_index, block_index in enumerate(mapping):
        offsets[block_index] = int(placement.offsets[buffer_index])
    table = PlanTable.build(1, sizes, offsets, placement.height, 256)
    names = {1: "alloc", 2: "free", 6: "iter"}
    script = [
        (names[int(k)], int(b), int(s))
        for k, b, s in zip(events.kinds, events.block_ids, events.sizes, strict=True)
        if int(k) in names
    ]
    return table, script
