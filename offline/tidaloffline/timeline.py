"""The simulated step as a timeline for Perfetto's UI and chrome://tracing.

One JSON object in the Chrome trace event format: `traceEvents` and
`displayTimeUnit`. Each plan is a process (pid 1, 2, ... in the order given),
named by its policy, with three tracks (threads) and a counter:

    compute    ─[op]─[op]─[recompute]─[op]──[op]─▶   "X" events, one per op and per rebuild
    swap-out          └[out b12]──[out b7]           "X" events, one per copy, block in
    swap-in                     └[in b12]            name and args (id, bytes, ops)
    device bytes ▁▂▄▆█▆▄▂▁                           "C" events: resident bytes over time,
                                                     the persistent blocks included

Times are the simulator's (`simulate.Result`): an op starts at its tick's time
(`tick_ns`, after any wait) and lasts its scaled duration; a swap-out ends when its
bytes left (`swap_ns`) and a swap-in starts when they came back, each copy lasting
`copy_ns` at its bandwidth; a rebuild starts at `rebuild_ns` and lasts its writers'
time. `ts` and `dur` are microseconds, as the format has them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidalclient.timeline import names
from tidalcore.units import format_size
from tidalplan.accesses import accesses
from tidalplan.model import Iteration
from tidalplan.simulate import Result, copy_ns, rebuilds

if TYPE_CHECKING:
    from tidalplan.combined import Plan
    from tidalplan.model import SwapPlan
    from tidalplan.paged import PagedPlan

COMPUTE, SWAP_OUT, SWAP_IN = 1, 2, 3
TRACKS = {COMPUTE: "compute", SWAP_OUT: "swap-out", SWAP_IN: "swap-in"}
COUNTER = "device bytes"


def _us(ns: int) -> float:
    """Nanoseconds as the format's microseconds (exact to the nanosecond below 2**53 ns)."""
    return ns / 1000


def process(
    it: Iteration,
    name: str,
    plan: Plan | PagedPlan,
    pid: int,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
) -> list[dict[str, Any]]:
    """The events of one plan's simulated step as process `pid` called `name`. ValueError
    when its schedule did not run to the end (an infeasible step has no timeline). A paged
    plan's step is that of the iteration it was made on (`paged.paged`: blocks in whole
    pages)."""
    from tidalplan import paged

    if isinstance(plan, paged.PagedPlan):
        it = paged.paged(it, plan.layout)
    return steps(it, plan.schedule, plan.result, name, pid, out_gbps, in_gbps, compute_scale)


def steps(
    it: Iteration,
    schedule: SwapPlan,
    result: Result,
    name: str,
    pid: int,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
    at_ns: Sequence[int] = (0,),
) -> list[dict[str, Any]]:
    """The events of `schedule`'s simulated step on `it` (the iteration as simulated) as
    process `pid` called `name`, once from each start in `at_ns`. ValueError when it did
    not run to the end."""
    if not result.feasible:
        raise ValueError(f"{name}: the schedule did not run under its limit: no timeline")
    events = names(pid, name, TRACKS)
    durations = accesses(it).scaled(compute_scale)
    for op in it.ops:
        tick = int(op.tick)
        events.append(
            {
                "ph": "X",
                "cat": "op",
                "name": op.name or f"op {tick}",
                "pid": pid,
                "tid": COMPUTE,
                "ts": _us(result.tick_ns[tick]),
                "dur": _us(durations[tick]),
                "args": {"tick": tick},
            }
        )
    for before, rebuild in sorted(rebuilds(it, schedule, durations).items()):
        blocks = [it.blocks[schedule.recomputes[j].block].id for j in rebuild.members]
        events.append(
            {
                "ph": "X",
                "cat": "recompute",
                "name": f"recompute {', '.join(f'b{b}' for b in blocks)}"
                f" ({format_size(rebuild.size)})",
                "pid": pid,
                "tid": COMPUTE,
                "ts": _us(result.rebuild_ns[rebuild.members[0]]),
                "dur": _us(rebuild.ns),
                "args": {
                    "blocks": blocks,
                    "bytes": rebuild.size,
                    "scratch_bytes": rebuild.scratch,
                    "before_tick": before,
                },
            }
        )
    for swap, (gone, back) in zip(schedule.swaps, result.swap_ns, strict=True):
        block, size = it.persistent[swap.block] if swap.persistent else _transient(it, swap.block)
        args = {
            "block": int(block),
            "bytes": int(size),
            "persistent": swap.persistent,
            "out_after_tick": int(swap.out_after),
            "in_before_tick": int(swap.in_before),
        }
        out_ns, in_ns = copy_ns(size, out_gbps), copy_ns(size, in_gbps)
        label = f"b{block} ({format_size(size)})"
        for tid, cat, start, ns in (
            (SWAP_OUT, "swap-out", gone - out_ns, out_ns),
            (SWAP_IN, "swap-in", back, in_ns),
        ):
            events.append(
                {
                    "ph": "X",
                    "cat": cat,
                    "name": f"{'out' if tid == SWAP_OUT else 'in'} {label}",
                    "pid": pid,
                    "tid": tid,
                    "ts": _us(start),
                    "dur": _us(ns),
                    "args": args,
                }
            )
    for at, resident in result.curve:
        events.append(
            {
                "ph": "C",
                "name": COUNTER,
                "pid": pid,
                "tid": 0,
                "ts": _us(at),
                "args": {"resident": int(resident)},
            }
        )
    if tuple(at_ns) == (0,):
        return events
    meta = [e for e in events if e["ph"] == "M"]
    timed = [e for e in events if e["ph"] != "M"]
    return meta + [{**e, "ts": e["ts"] + _us(at)} for at in at_ns for e in timed]


def _transient(it: Iteration, index: int) -> tuple[int, int]:
    b = it.blocks[index]
    return b.id, int(b.size)


def document(
    it: Iteration,
    plans: Sequence[tuple[str, Plan | PagedPlan]],
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
) -> dict[str, Any]:
    """The Chrome trace event object of the plans' steps, one process per plan."""
    events: list[dict[str, Any]] = []
    for pid, (name, plan) in enumerate(plans, start=1):
        events.extend(process(it, name, plan, pid, out_gbps, in_gbps, compute_scale))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "out_gbps": out_gbps,
            "in_gbps": in_gbps,
            "compute_scale": compute_scale,
            "iteration": it.index,
        },
    }


def write(
    path: str | Path,
    it: Iteration,
    plans: Sequence[tuple[str, Plan | PagedPlan]],
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
) -> None:
    """Write `document` to `path` as JSON (OSError if it cannot be written)."""
    text = json.dumps(document(it, plans, out_gbps, in_gbps, compute_scale), separators=(",", ":"))
    Path(path).write_text(text, encoding="utf-8")
