"""Driving a session through a trace's iteration, tick by tick, as a training job would.

`script` turns the iteration into what each tick does (alloc, free, or an op and the block
instances it reads and writes); `Replayer` runs it in a session, each op's compute on a
`Compute` stream, and keeps one `Record` per iteration (differences of the session's counters).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidalclient.timeline import HOST_TRACK

from tidaloffline.replay.compute import Compute, Mark

if TYPE_CHECKING:
    from tidalclient.executors.base import Block, SwapStats
    from tidalclient.session import Session
    from tidalclient.timeline import Timeline
    from tidalplan.model import Iteration

# -- the iteration as a script ---------------------------------------------------------------------

Ref = tuple[str, int, int]
"""A block an op accesses: ("block", index in `Iteration.blocks`, age: 0 the instance allocated
in this iteration, 1 the previous iteration's, ...) or ("persistent", index, 0)."""


@dataclass(frozen=True, slots=True)
class Script:
    """One iteration as the replay runs it. `at[t]`: what tick t does, ("alloc", block index)
    or ("op", op index); a free is scheduled when its block is allocated (`frees[i]`: the
    iteration after the allocation's, counted from it, and the tick there)."""

    ticks: int
    at: tuple[tuple[str, int] | None, ...]
    frees: tuple[tuple[int, int], ...]  # per block: (iterations later, tick)
    reads: tuple[tuple[Ref, ...], ...]  # per op
    writes: tuple[tuple[Ref, ...], ...]
    unresolved: int  # accesses to ids that are none of the iteration's blocks


def script(it: Iteration) -> Script:
    """The replay's script of `it`. A block freed in a later iteration (it crosses the
    boundary) is freed at its tick there; an access names the instance live at its tick."""
    at: list[tuple[str, int] | None] = [None] * it.ticks
    for i, b in enumerate(it.blocks):
        at[b.start] = ("alloc", i)
    ops = it.ops
    for k, op in enumerate(ops):
        at[op.tick] = ("op", k)
    frees = tuple(divmod(int(b.end), it.ticks) for b in it.blocks)
    index = {b.id: i for i, b in enumerate(it.blocks)}
    persistent = {pid: j for j, (pid, _) in enumerate(it.persistent)}
    op_of = {op.tick: k for k, op in enumerate(ops)}
    reads: list[list[Ref]] = [[] for _ in ops]
    writes: list[list[Ref]] = [[] for _ in ops]
    unresolved = 0
    for a in it.accesses:
        ref = _resolve(it, index, persistent, a.block, a.tick)
        if ref is None:
            unresolved += 1
            continue
        (writes if a.write else reads)[op_of[a.tick]].append(ref)
    return Script(
        it.ticks,
        tuple(at),
        frees,
        tuple(tuple(r) for r in reads),
        tuple(tuple(w) for w in writes),
        unresolved,
    )


def _resolve(
    it: Iteration, index: dict[int, int], persistent: dict[int, int], block: int, tick: int
) -> Ref | None:
    if block in persistent:
        return ("persistent", persistent[block], 0)
    i = index.get(block)
    if i is None:
        return None
    b = it.blocks[i]
    age = 0 if tick > b.start else -(-(b.start - tick) // it.ticks)
    return ("block", i, age) if tick + age * it.ticks < b.end else None


# -- running iterations ----------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Held:
    """A block of the replay: its serial (never reused) and how often it was written."""

    block: Block
    serial: int
    writes: int = 0


@dataclass(frozen=True, slots=True)
class Record:
    """One iteration as it ran: its phase ("learning"; "switch": the first under the plan;
    "steady"; "fell back": it left the plan), its wall time from its `step()` to the next, and
    what it moved and checked (differences of the session's counters)."""

    index: int
    phase: str
    mode: str
    step_ns: int
    planned_out_bytes: int
    planned_in_bytes: int
    on_demand_out_bytes: int
    on_demand_in_bytes: int
    stall_ns: int
    piece_misses: int
    footprint_bytes: int
    mismatches: int
    stamps_checked: int
    not_resident: int
    host_cpu_ns: int = 0  # CPU time of the training thread in it: issuing, allocating, not waits


COUNTERS = (
    "planned_out_bytes",
    "planned_in_bytes",
    "on_demand_out_bytes",
    "on_demand_in_bytes",
    "stall_ns",
    "piece_misses",
)


def _counters(swap: SwapStats | None) -> dict[str, int]:
    return {name: int(getattr(swap, name, 0)) for name in COUNTERS}


class Replayer:
    """Runs a script's iterations in a session, on a compute stream; each iteration's step
    names `shape` (the iteration shape of a trace of several, "" for one)."""

    def __init__(
        self,
        session: Session,
        it: Iteration,
        compute: Compute,
        compute_scale: float,
        shape: str = "",
    ) -> None:
        from tidalclient.executors.base import ARRIVING, DEVICE

        self.session = session
        self.it = it
        self.shape = shape
        self.script = script(it)
        self.compute = compute
        self.durations = [round(op.duration_ns * compute_scale) for op in it.ops]
        self.names = [op.name or "op" for op in it.ops]
        self._resident = (DEVICE, ARRIVING)  # ARRIVING: the compute stream waits for it
        self._serials = 0
        self.persistent: list[_Held] = []
        self._live: dict[tuple[int, int], _Held] = {}  # (block index, iteration) -> held
        self._due: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (iteration, tick) -> keys
        self._iteration = 0
        self.not_resident = 0
        self.missing = 0  # accesses to an instance not live (a previous one, early on)
        self.records: list[Record] = []
        self.spans: list[tuple[int, int]] = []  # per iteration: (start, end), perf_counter_ns
        self.timeline: Timeline | None = None  # each iteration a span on its host track
        self.planned_once = False
        self.fell_back = False

    def _new(self, nbytes: int) -> _Held:
        self._serials += 1
        return _Held(self.session.malloc(nbytes), self._serials)

    def setup(self, shared: dict[int, _Held] | None = None) -> None:
        """Allocate the persistent blocks and write each once (one op each, so that the limit
        needs room for one at a time). `shared`: persistent blocks by trace id, of replayers of
        the trace's other shapes: one of the same id and size is taken from it, not made again;
        those made here are added to it."""
        shared = {} if shared is None else shared
        for pid, size in self.it.persistent:
            held = shared.get(pid)
            if held is None or held.block.size != size:
                held = shared[pid] = self._new(int(size))
                self._op("replay.init", 0, (), (held,))
            self.persistent.append(held)
        self.compute.synchronize()

    def _op(self, name: str, ns: int, reads: Sequence[_Held], writes: Sequence[_Held]) -> None:
        session = self.session
        residency = session.residency
        assert residency is not None  # a replay's session always has a swap limit
        where = residency.where
        lo, span = session.addresses
        hi = lo + span
        with session.op(
            reads=[h.block for h in reads],
            writes=[h.block for h in writes],
            name=name,
            duration_ns=ns,
        ) as views:
            checks: list[Mark] = []
            for h, view in zip(reads, views[: len(reads)], strict=True):
                if h.writes:
                    checks.append(Mark(view, int(h.block.size), h.serial, h.writes))
            stamps: list[Mark] = []
            for h, view in zip(writes, views[len(reads) :], strict=True):
                h.writes += 1
                stamps.append(Mark(view, int(h.block.size), h.serial, h.writes))
            for h, view in zip((*reads, *writes), views, strict=True):
                address = view if isinstance(view, int) else _address(view)
                if where(h.block) not in self._resident or not lo <= address < hi:
                    self.not_resident += 1
            self.compute.run(ns, checks, stamps, name)

    def _held(self, ref: Ref) -> _Held | None:
        kind, i, age = ref
        if kind == "persistent":
            return self.persistent[i]
        held = self._live.get((i, self._iteration - age))
        if held is None:
            self.missing += 1
        return held

    def _free_due(self, tick: int) -> None:
        for key in self._due.pop((self._iteration, tick), ()):
            held = self._live.pop(key, None)
            if held is not None:
                self.session.free(held.block)

    def iteration(self) -> Record:
        """Run one iteration: `step()`, its ticks in order, then wait for its compute."""
        session, sc, n = self.session, self.script, self._iteration
        stats = session.executor.stats
        before = _counters(stats().swap)
        wrong0, checked0 = self.compute.counts()
        not_resident0 = self.not_resident
        start = time.perf_counter_ns()
        cpu = time.thread_time_ns()
        session.step(shape=self.shape)
        mode_at_start = stats().mode
        for t, what in enumerate(sc.at):
            self._free_due(t)
            if what is None:
                continue
            kind, k = what
            if kind == "alloc":
                held = self._new(int(self.it.blocks[k].size))
                self._live[(k, n)] = held
                later, tick = sc.frees[k]
                self._due.setdefault((n + later, tick), []).append((k, n))
            else:
                reads = [h for r in sc.reads[k] if (h := self._held(r)) is not None]
                writes = [h for r in sc.writes[k] if (h := self._held(r)) is not None]
                self._op(self.names[k], self.durations[k], reads, writes)
        self.compute.synchronize()
        step_ns = time.perf_counter_ns() - start
        cpu = time.thread_time_ns() - cpu
        now = stats()
        after = _counters(now.swap)
        wrong, checked = self.compute.counts()
        if now.mode != "planned" or mode_at_start != "planned":
            phase = "fell back" if self.planned_once else "learning"
            self.fell_back = self.planned_once
        else:
            phase = "steady" if self.planned_once else "switch"
            self.planned_once = True
        record = Record(
            index=n,
            phase=phase,
            mode=now.mode,
            step_ns=step_ns,
            host_cpu_ns=cpu,
            planned_out_bytes=after["planned_out_bytes"] - before["planned_out_bytes"],
            planned_in_bytes=after["planned_in_bytes"] - before["planned_in_bytes"],
            on_demand_out_bytes=after["on_demand_out_bytes"] - before["on_demand_out_bytes"],
            on_demand_in_bytes=after["on_demand_in_bytes"] - before["on_demand_in_bytes"],
            stall_ns=after["stall_ns"] - before["stall_ns"],
            piece_misses=after["piece_misses"] - before["piece_misses"],
            footprint_bytes=now.high_water,
            mismatches=wrong - wrong0,
            stamps_checked=checked - checked0,
            not_resident=self.not_resident - not_resident0,
        )
        self.records.append(record)
        self.spans.append((start, start + step_ns))
        if self.timeline is not None:
            self.timeline.span(HOST_TRACK, f"iteration {n} ({phase})", start, start + step_ns)
        self._iteration += 1
        return record


def _address(view: Any) -> int:
    return int(view.__array_interface__["data"][0])
