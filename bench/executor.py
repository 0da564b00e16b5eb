"""Latency of a malloc+free pair through the learning-mode PythonExecutor, against a naive
first-fit.

Workloads: (a) one size allocated and freed over and over in an empty lease; (a') the same
behind 1000 free 256 B holes, where a first fit must walk past every hole; (b) the alloc/free
events of one training iteration of a real trace (ResNet-50, batch 32), replayed again and
again in steady state in a lease of twice the peak live bytes.

Allocators: `PythonExecutor` (what a session calls: validation, Block, counters), the bare `BestFit`
under it, and `NaiveFirstFit`, a first fit over a Python list written below as the baseline.

Each malloc and each free is timed on its own (perf_counter_ns, the timer's own cost
subtracted); a pair's latency is its malloc's plus its free's: "median" and "p99" are over
pairs. "loop" is the same sequence without timers: time / pairs, the median over the rounds.
"high water" is the highest byte ever handed out. Rounds alternate the allocators so that noise
from other processes falls on all of them alike; the garbage collector is off while timing.

    .venv/bin/python bench/executor.py [--json] [--trace FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidalclient.executors.bestfit import BestFit
from tidalclient.executors.python import PythonExecutor
from tidalclient.plans import Plan, PlanTable
from tidalcore.units import format_size

# The shared data sits beside the repository (../shared), as on every developer machine and CI.
TRACES = (str(Path(__file__).resolve().parents[2] / "shared/traces/models"),)
TRACE = "resnet50.b32.trace.csv"
SINGLE_SIZE = 1 << 20
SINGLE_PAIRS = 5_000  # per round
HOLES = 1000
REPLAYS = 20  # per round
ROUNDS = 5
ALLOCATORS = ("Executor", "Executor, planned", "BestFit", "NaiveFirstFit")


class NaiveFirstFit:
    """Baseline: first fit over a Python list of free [offset, size] ranges sorted by offset."""

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        self.mask = alignment - 1
        self.free_list: list[list[int]] = [[0, capacity & ~self.mask]]
        self.live: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int | None:
        size = (nbytes + self.mask) & ~self.mask
        for i, hole in enumerate(self.free_list):  # first hole that fits
            if hole[1] >= size:
                offset = hole[0]
                if hole[1] == size:
                    del self.free_list[i]
                else:
                    hole[0] += size
                    hole[1] -= size
                self.live[offset] = size
                return offset
        return None

    def release(self, offset: int) -> int:
        size = self.live.pop(offset)
        free = self.free_list
        i = bisect_left(free, [offset, 0])
        if i < len(free) and free[i][0] == offset + size:  # merge with the right neighbour
            free[i][0] = offset
            free[i][1] += size
        else:
            free.insert(i, [offset, size])
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # and with the left one
            free[i - 1][1] += free[i][1]
            del free[i]
        return size


Malloc = Callable[[int], Any]
Free = Callable[[Any], Any]


@dataclass(frozen=True)
class Replay:
    """One steady-state iteration: setup allocations, then ops, then the carry-over renaming."""

    setup: list[tuple[int, int]]  # (trace id, bytes) live when the iteration starts
    ops: list[tuple[int, int]]  # (trace id, bytes) for a malloc, (trace id, 0) for a free
    carry: list[tuple[int, int]]  # (survivor, carried-in): a survivor plays that role next time
    peak_live: int
    pairs: int


def load_replay(path: Path) -> Replay:
    """Iteration 1 of a trace CSV v1, closed into a loop.

    Every block live at `iter,1` is allocated in the setup: the persistent ones (allocated
    before the first `iter` line) and those iteration 0 left behind (optimizer state, and the
    gradients that iteration 1 frees). The blocks of iteration 1 that iteration 2 frees take
    the place of the ones iteration 1 freed, matched by the order in which they are freed.
    """
    sizes: dict[int, int] = {}
    born: dict[int, int] = {}
    live: dict[int, None] = {}  # insertion-ordered set
    setup: list[tuple[int, int]] = []
    ops: list[tuple[int, int]] = []
    carried_in: list[int] = []
    survivors: list[int] = []
    it = -1
    for line in path.read_text().splitlines():
        if line.startswith("#") or line.startswith("kind,"):
            continue
        kind, ident, size = line.split(",", 3)[:3]
        block = int(ident)
        if kind == "iter":
            it = block
            if it == 1:
                setup = [(b, sizes[b]) for b in live]
            elif it == 3:
                break
        elif kind == "alloc":
            sizes[block] = int(size)
            born[block] = it
            live[block] = None
            if it == 1:
                ops.append((block, int(size)))
        elif kind == "free":
            del live[block]
            if it == 1:
                ops.append((block, 0))
                if born[block] < 1:
                    carried_in.append(block)
            elif it == 2 and born[block] == 1:
                survivors.append(block)
    carry = list(zip(survivors, carried_in, strict=False))
    if not ops or len(survivors) != len(carried_in) or any(sizes[s] != sizes[c] for s, c in carry):
        raise SystemExit(f"{path}: iterations 1 and 2 differ; cannot replay iteration 1 in a loop")
    now = peak = sum(nbytes for _, nbytes in setup)
    for block, nbytes in ops:
        now += nbytes if nbytes else -sizes[block]
        peak = max(peak, now)
    return Replay(setup, ops, carry, peak, sum(1 for _, nbytes in ops if nbytes))


PLANS: dict[str, PlanTable] = {}  # the plan of the replayed iteration, made once in main()


def make(kind: str, capacity: int) -> tuple[Malloc, Free, Callable[[Any], int]]:
    """malloc, free, and the offset of what malloc returned, for one allocator."""
    if kind.startswith("Executor"):
        ex = PythonExecutor(capacity)
        if kind == "Executor, planned":
            EXECUTORS.append(ex)
        return ex.malloc, ex.free, lambda block: int(block.offset)
    fit = BestFit(capacity) if kind == "BestFit" else NaiveFirstFit(capacity)

    def malloc(nbytes: int) -> int:
        offset = fit.allocate(nbytes)
        if offset is None:
            raise MemoryError(f"{kind}: {nbytes} bytes do not fit")
        return offset

    return malloc, fit.release, int


def timer_overhead() -> int:
    clock = time.perf_counter_ns
    return min(-clock() + clock() for _ in range(20_000))


@dataclass
class Sample:
    """What the rounds of one workload on one allocator measured."""

    latencies: list[int] = field(default_factory=list)  # timed pairs, ns
    untimed: list[float] = field(default_factory=list)  # per round: ns per pair, no timers
    high_water: int = 0
    hits: int = 0  # planned executor: allocations served by the plan
    misses: int = 0


def single(kind: str, holes: int, overhead: int, out: Sample) -> None:
    """malloc+free of SINGLE_SIZE, behind `holes` free 256 B holes left by freed blocks."""
    malloc, free, _ = make(kind, 64 << 20)
    blocks = [malloc(256) for _ in range(2 * holes)]
    for h in blocks[::2]:
        free(h)
    clock = time.perf_counter_ns
    lat = out.latencies
    for _ in range(SINGLE_PAIRS):
        t0 = clock()
        h = malloc(SINGLE_SIZE)
        t1 = clock()
        free(h)
        lat.append(clock() - t1 + t1 - t0 - 2 * overhead)
    t0 = clock()
    for _ in range(SINGLE_PAIRS):
        free(malloc(SINGLE_SIZE))
    out.untimed.append((clock() - t0) / SINGLE_PAIRS)


def mix(kind: str, replay: Replay, overhead: int, out: Sample) -> None:
    """REPLAYS iterations timed op by op, then REPLAYS more untimed."""
    malloc, free, offset_of = make(kind, 2 * replay.peak_live)
    handles = {b: malloc(size) for b, size in replay.setup}
    begin: Callable[[], None] = lambda: None  # noqa: E731
    if kind == "Executor, planned":  # the setup was learned online; the iteration runs planned
        ex = EXECUTORS[-1]
        ex.install_plan(Plan(PLANS["replay"]))
        begin = ex.step
    high = max(offset_of(handles[b]) + size for b, size in replay.setup)
    clock = time.perf_counter_ns
    pending: dict[int, int] = {}  # block -> its malloc's ns, until it is freed
    lat = out.latencies
    for _ in range(REPLAYS):
        begin()
        for block, size in replay.ops:
            if size:
                t0 = clock()
                h = malloc(size)
                pending[block] = clock() - t0 - overhead
                handles[block] = h
                high = max(high, offset_of(h) + size)
            else:
                t0 = clock()
                free(handles.pop(block))
                took = clock() - t0 - overhead
                if block in pending:
                    lat.append(pending.pop(block) + took)
        rename(handles, replay.carry)
        rename(pending, replay.carry)
    ops = replay.ops
    t0 = clock()
    for _ in range(REPLAYS):
        begin()
        for block, size in ops:
            if size:
                handles[block] = malloc(size)
            else:
                free(handles.pop(block))
        rename(handles, replay.carry)
    out.untimed.append((clock() - t0) / (REPLAYS * replay.pairs))
    out.high_water = max(out.high_water, high)
    if kind == "Executor, planned":
        out.misses += EXECUTORS[-1].plan_misses
        out.hits += EXECUTORS[-1].plan_hits


def rename(table: dict[int, Any], carry: list[tuple[int, int]]) -> None:
    """Survivors of this iteration play the blocks the next one frees first."""
    for survivor, carried_in in carry:
        if survivor in table:
            table[carried_in] = table.pop(survivor)


def measure(replay: Replay, overhead: int) -> list[dict[str, Any]]:
    """Every workload on every allocator, in ROUNDS interleaved rounds (noise hits all alike)."""
    workloads: dict[str, Callable[[str, Sample], None]] = {
        f"{format_size(SINGLE_SIZE)}": lambda k, out: single(k, 0, overhead, out),
        f"{format_size(SINGLE_SIZE)}, {HOLES} holes": lambda k, out: single(
            k, HOLES, overhead, out
        ),
        "resnet50 iter": lambda k, out: mix(k, replay, overhead, out),
    }
    samples = {
        (w, k): Sample()
        for w in workloads
        for k in ALLOCATORS
        if w == "resnet50 iter" or k != "Executor, planned"  # a plan exists for the replay only
    }
    for _ in range(ROUNDS):
        for (workload, kind), out in samples.items():
            workloads[workload](kind, out)
    results = []
    for (workload, kind), out in samples.items():
        lat = sorted(out.latencies)
        results.append(
            {
                "workload": workload,
                "allocator": kind,
                "median_ns": statistics.median(lat),
                "p99_ns": lat[int(0.99 * (len(lat) - 1))],
                "loop_ns": statistics.median(out.untimed),
                "timed_pairs": len(lat),
                "high_water_bytes": out.high_water or None,
                "plan_hits": out.hits,
                "plan_misses": out.misses,
            }
        )
    return results


EXECUTORS: list[PythonExecutor] = []


def make_plan(path: Path, replay: Replay) -> PlanTable:
    """The daemon's plan for the replayed iteration: learn, place (exact search), validate."""
    from tidaloffline.formats import read_trace_csv
    from tidalplan.learn import extract, to_problem
    from tidalplan.placement import solve
    from tidalplan.validate import validate

    events = read_trace_csv(path)
    iteration = extract(events, events.marks())
    sizes = [b.size for b in iteration.blocks]
    if sizes != [size for _, size in replay.ops if size]:
        raise SystemExit(f"{path}: the learned iteration is not the replayed one")
    problem, mapping = to_problem(iteration, alignment=256)
    placement = solve(problem, time_limit_s=10.0)
    validate(problem, placement)
    offsets = [0] * len(sizes)
    for buffer_index, block_index in enumerate(mapping):
        offsets[block_index] = placement.offsets[buffer_index]
    return PlanTable.build(1, sizes, offsets, placement.height, 256)


def find_trace() -> Path:
    for folder in TRACES:
        if (Path(folder) / TRACE).exists():
            return Path(folder) / TRACE
    return Path(TRACES[-1]) / TRACE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--trace", type=Path, default=None, help=f"trace CSV (default {TRACE})")
    args = parser.parse_args(argv)
    path = args.trace or find_trace()
    replay = load_replay(path)
    PLANS["replay"] = make_plan(path, replay)
    overhead = timer_overhead()
    gc.disable()
    try:
        results = measure(replay, overhead)
    finally:
        gc.enable()
    info = {
        "trace": str(path),
        "python": sys.version.split()[0],
        "timer_overhead_ns": overhead,
        "setup_blocks": len(replay.setup),
        "pairs_per_iteration": replay.pairs,
        "peak_live_bytes": replay.peak_live,
        "lease_bytes": 2 * replay.peak_live,
        "rounds": ROUNDS,
        "replays_per_round": REPLAYS,
        "single_pairs_per_round": SINGLE_PAIRS,
        "results": results,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(
        f"{path.name}: {len(replay.setup)} blocks live at iter 1, {replay.pairs} malloc+free pairs"
        f" an iteration, lease {format_size(2 * replay.peak_live)} (2 x peak live"
        f" {format_size(replay.peak_live)}); timer overhead {overhead} ns subtracted"
    )
    print(
        f"{'workload':<20}{'allocator':<19}{'median ns':>10}{'p99 ns':>10}{'loop ns':>10}"
        f"{'high water':>12}{'plan misses':>13}"
    )
    for r in results:
        high = format_size(r["high_water_bytes"]) if r["high_water_bytes"] else ""
        planned = r["allocator"] == "Executor, planned"
        misses = f"{r['plan_misses']}/{r['plan_hits'] + r['plan_misses']}" if planned else ""
        print(
            f"{r['workload']:<20}{r['allocator']:<19}{r['median_ns']:>10.0f}"
            f"{r['p99_ns']:>10.0f}{r['loop_ns']:>10.0f}{high:>12}{misses:>13}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
