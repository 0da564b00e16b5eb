"""The native hot path: malloc+free pair latency in C loops, through the Python boundary, and the
Python planned executor as the baseline; the trace ring's drain rate.

Pairs (ns per malloc+free pair; the median over rounds of round time / pairs in the round):
  - "C loop": `tidalpool_bench_replay` runs the script in C and times each round with
    clock_gettime, so no Python call is inside the measurement; each round starts with
    `tidalpool_step` (included). Every malloc and free writes a trace event stamped with
    clock_gettime; between calls of the loop (untimed) Python drains the ring, as the
    recorder's thread would, so it stays warm and drops nothing.
  - "unstamped": the same with `timestamps=False` (events carry t_ns = 0: no clock read).
  - "via HotPath": the same script driven from Python, one `HotPath.alloc`/`free` per op
    (ctypes plus argument checks): what a Python caller pays, not what PyTorch pays.
  - "via raw ctypes": the same, calling the library's functions directly without the checks.
  - "Python Executor": tidalclient.executors.python.Executor with the same plan, the baseline.
Workloads: a synthetic plan of 1,024 slots of 1 MiB with no shared bytes, one alloc+free per
slot; the same without a plan (online best-fit, one free range) and behind 1,000 free holes;
and the steady iteration of a real trace (default ResNet-50, batch 32; see bench/executor.py
`load_replay`), planned with the daemon's plan (extract, solve, validate) and online.

Drain: 1,000,000 events are produced into a ring of 2**20 and drained from Python in batches
(`HotPath.drain_into`, a reused NumPy buffer) until empty; events/s over the drain loop. Also
converting them to the recorder's (kind, block, size) tuples (`recorder_events`).

    .venv/bin/python bench/native.py [--json] [--trace FILE]...
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from executor import Replay, find_trace, load_replay, make_plan  # bench/executor.py
from tidalclient.executors.python import PythonExecutor
from tidalclient.hotpath import EVENT_DTYPE, HotPath, library_path, load, recorder_events
from tidalclient.plans import Plan, PlanTable

BASE = 1 << 40  # the lease's address: nothing is dereferenced
MiB = 1 << 20
SLOTS = 1024
HOLES = 1000
C_ROUNDS = 300
RING = 1 << 16  # events; the recorder's default
PY_ROUNDS = 15
DRAIN_EVENTS = 1_000_000
BATCHES = (4096, 65536)


def u64(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


class Script:
    """A replay as the C loop takes it: dense handles, sizes (0: free), renames."""

    def __init__(self, replay: Replay) -> None:
        index: dict[int, int] = {}
        for block, _ in replay.setup + replay.ops:
            index.setdefault(block, len(index))
        for survivor, carried in replay.carry:
            index.setdefault(survivor, len(index))
            index.setdefault(carried, len(index))
        self.setup = [(index[b], size) for b, size in replay.setup]
        self.handles = u64([index[b] for b, _ in replay.ops])
        self.sizes = u64([size for _, size in replay.ops])
        self.renames = u64([i for s, c in replay.carry for i in (index[s], index[c])])
        self.table_size = len(index)
        self.pairs = replay.pairs
        self.peak = replay.peak_live


def pair_script(pairs: int, size: int) -> Script:
    replay = Replay([], [(0, size), (0, 0)] * pairs, [], size, pairs)
    return Script(replay)


def c_loop(
    hp: HotPath,
    script: Script,
    capacity: int,
    plan: PlanTable | None,
    holes: int = 0,
    timestamps: bool = True,
) -> dict[str, Any]:
    """Median ns per pair over C_ROUNDS rounds of the script run in C; hits and misses.

    The rounds run in calls of as many as half the ring holds; between calls (untimed) the
    events are drained, as the recorder's thread would: the ring stays warm and never drops."""
    hp.reset()
    hp.configure(BASE, capacity, ring_events=RING, timestamps=timestamps)
    table = np.zeros(script.table_size, dtype=np.uint64)
    for handle, size in script.setup:
        table[handle] = hp.alloc(size) or 0
    kept = [hp.alloc(256) for _ in range(2 * holes)]  # every other one freed: holes
    for address in kept[::2]:
        hp.free(address or 0)
    if plan is not None:
        hp.install_plan(plan)
    buffer = np.empty(RING, dtype=EVENT_DTYPE)
    per_call = max(1, (RING // 2) // (2 * script.pairs + 1))
    times: list[np.ndarray] = []
    done = 0
    while done < C_ROUNDS:
        rounds = min(per_call, C_ROUNDS - done)
        failed, ns = hp.replay(table, script.handles, script.sizes, script.renames, rounds)
        if failed:
            raise SystemExit(f"{failed} allocations failed in the C loop")
        hp.drain_into(buffer)
        times.append(ns)
        done += rounds
    stats = hp.stats()
    if stats.overflow:
        raise SystemExit(f"the ring overflowed ({stats.overflow} events)")
    per_pair = np.concatenate(times)[1:] / script.pairs  # round 0 switches to the plan
    hp.reset()
    return {
        "median_ns": float(np.median(per_pair)),
        "p99_round_ns_per_pair": float(np.percentile(per_pair, 99)),
        "hits": stats.hits,
        "misses": stats.misses,
    }


def python_loop(script: Script, run: Callable[[], None], begin: Callable[[], None]) -> float:
    """Median ns per pair over PY_ROUNDS rounds of `run` (one round), `begin` untimed first."""
    per_pair = []
    for _ in range(PY_ROUNDS):
        begin()
        t0 = time.perf_counter_ns()
        run()
        per_pair.append((time.perf_counter_ns() - t0) / script.pairs)
    return statistics.median(per_pair)


def via_hotpath(
    hp: HotPath, script: Script, capacity: int, plan: PlanTable | None, raw: bool
) -> float:
    hp.reset()
    hp.configure(BASE, capacity, ring_events=1 << 16)
    table = [0] * script.table_size
    for handle, size in script.setup:
        table[handle] = hp.alloc(size) or 0
    if plan is not None:
        hp.install_plan(plan)
    ops = list(zip(script.handles.tolist(), script.sizes.tolist(), strict=True))
    renames = script.renames.reshape(-1, 2).tolist()
    lib = load()
    c_alloc, c_free, device = lib.tidalpool_alloc, lib.tidalpool_free, hp.device
    alloc: Callable[[int], int | None] = hp.alloc
    free: Callable[[int], None] = hp.free
    if raw:
        alloc = lambda n: c_alloc(n, device, None)  # noqa: E731
        free = lambda p: c_free(p, 0, device, None)  # noqa: E731

    def run() -> None:
        hp.step()  # included, as in the C loop
        for handle, size in ops:
            if size:
                table[handle] = alloc(size) or 0
            else:
                free(table[handle])
        for a, b in renames:
            table[b] = table[a]

    ns = python_loop(script, run, lambda: None)
    stats = hp.stats()
    if plan is not None and stats.misses:
        raise SystemExit(f"{stats.misses} plan misses through the Python boundary")
    hp.reset()
    return ns


def python_executor(script: Script, capacity: int, plan: PlanTable | None) -> float:
    ex = PythonExecutor(capacity)
    table: list[Any] = [None] * script.table_size
    for handle, size in script.setup:
        table[handle] = ex.malloc(size)
    if plan is not None:
        ex.install_plan(Plan(plan))
    ops = list(zip(script.handles.tolist(), script.sizes.tolist(), strict=True))
    renames = script.renames.reshape(-1, 2).tolist()
    malloc, free = ex.malloc, ex.free

    def run() -> None:
        ex.step()  # included, as in the C loop
        for handle, size in ops:
            if size:
                table[handle] = malloc(size)
            else:
                free(table[handle])
        for a, b in renames:
            table[b] = table[a]

    ns = python_loop(script, run, lambda: None)
    if plan is not None and ex.plan_misses:
        raise SystemExit(f"{ex.plan_misses} plan misses in the Python executor")
    return ns


def synthetic_plan() -> PlanTable:
    return PlanTable.build(1, [MiB] * SLOTS, [k * MiB for k in range(SLOTS)], SLOTS * MiB, 256)


def pairs(hp: HotPath, traces: list[Path]) -> list[dict[str, Any]]:
    synthetic = pair_script(SLOTS, MiB)
    lease = 2 * SLOTS * MiB + 2 * HOLES * 256
    cases: list[tuple[str, Script, int, PlanTable | None, int]] = [
        ("1 MiB, plan of 1,024 slots", synthetic, lease, synthetic_plan(), 0),
        ("1 MiB, online, 1 free range", synthetic, lease, None, 0),
        (f"1 MiB, online, {HOLES:,} holes", synthetic, lease, None, HOLES),
    ]
    for trace in traces:
        replay = load_replay(trace)
        real = Script(replay)
        name = trace.name.split(".")[0]
        cases += [
            (f"{name} iteration, planned", real, 2 * real.peak, make_plan(trace, replay), 0),
            (f"{name} iteration, online", real, 2 * real.peak, None, 0),
        ]
    rows: list[dict[str, Any]] = []
    for label, script, capacity, plan, holes in cases:
        row: dict[str, Any] = {"workload": label, "pairs_per_round": script.pairs}
        row |= c_loop(hp, script, capacity, plan, holes)
        unstamped = c_loop(hp, script, capacity, plan, holes, timestamps=False)
        row["no_timestamps_ns"] = unstamped["median_ns"]
        if not holes:
            row["via_hotpath_ns"] = via_hotpath(hp, script, capacity, plan, raw=False)
            row["via_raw_ctypes_ns"] = via_hotpath(hp, script, capacity, plan, raw=True)
            row["python_executor_ns"] = python_executor(script, capacity, plan)
        rows.append(row)
    return rows


def drain(hp: HotPath) -> list[dict[str, Any]]:
    """Events/s draining a ring holding DRAIN_EVENTS, per batch size; and the tuple conversion."""
    rows = []
    script = pair_script(1000, 4096)  # 2,001 events a round, with its step
    rounds = DRAIN_EVENTS // (2 * script.pairs + 1)
    for batch in BATCHES:
        hp.reset()
        hp.configure(BASE, 1 << 30, ring_events=1 << 20)
        hp.replay(np.zeros(1, np.uint64), script.handles, script.sizes, script.renames, rounds)
        produced = hp.stats().events
        assert hp.stats().overflow == 0
        buffer = np.empty(batch, dtype=EVENT_DTYPE)
        t0 = time.perf_counter_ns()
        total = 0
        while n := hp.drain_into(buffer):
            total += n
        seconds = (time.perf_counter_ns() - t0) / 1e9
        assert total == produced
        rows.append(
            {
                "what": f"drain_into, batches of {batch:,}",
                "events": total,
                "events_per_s": total / seconds,
            }
        )
    hp.reset()
    hp.configure(BASE, 1 << 30, ring_events=1 << 20)
    hp.replay(np.zeros(1, np.uint64), script.handles, script.sizes, script.renames, rounds)
    events = hp.drain(max_events=1 << 20)
    t0 = time.perf_counter_ns()
    converted = sum(1 for _ in recorder_events(events))
    seconds = (time.perf_counter_ns() - t0) / 1e9
    rows.append(
        {
            "what": "recorder_events (tuples)",
            "events": converted,
            "events_per_s": converted / seconds,
        }
    )
    hp.reset()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--trace", type=Path, action="append", help="trace CSV (repeatable)")
    args = parser.parse_args(argv)
    traces = args.trace or [find_trace()]
    hp = HotPath(0)
    gc.disable()
    try:
        rows = pairs(hp, traces)
        drained = drain(hp)
    finally:
        gc.enable()
    info = {
        "library": str(library_path()),
        "python": sys.version.split()[0],
        "c_rounds": C_ROUNDS,
        "python_rounds": PY_ROUNDS,
        "pairs": rows,
        "drain": drained,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"ns per malloc+free pair, median over rounds ({C_ROUNDS} in C, {PY_ROUNDS} in Python)")
    print(
        f"{'workload':<34}{'C loop':>9}{'unstamped':>11}{'via HotPath':>13}{'raw ctypes':>12}"
        f"{'Py PythonExecutor':>13}{'plan misses':>13}"
    )
    for r in rows:
        misses = f"{r['misses']}/{r['hits'] + r['misses']}" if r["hits"] + r["misses"] else ""
        cells = [r.get(k) for k in ("via_hotpath_ns", "via_raw_ctypes_ns", "python_executor_ns")]
        text = [f"{c:>12,.0f}" if c is not None else f"{'':>12}" for c in cells]
        print(
            f"{r['workload']:<34}{r['median_ns']:>9.1f}{r['no_timestamps_ns']:>11.1f} {text[0]}"
            f"{text[1]} {text[2]}{misses:>13}"
        )
    print("trace ring")
    for d in drained:
        print(f"  {d['what']:<32}{d['events']:>11,} events {d['events_per_s'] / 1e6:>9.1f} M/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
