"""Who reads and writes what in an iteration, indexed once per iteration.

The simulator and the planners that rebuild blocks look up the same things: the blocks an op
reads and writes, the ops that write or touch a block, a block's index and size. `accesses`
builds them at an iteration's first use and keeps those of the last eight iterations used
(iterations are immutable); `derived` keeps other values made from an iteration beside them.
The validator keeps its own lookups, so that it checks the simulator independently.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar, cast

from tidalplan.learn import live_bytes
from tidalplan.model import Iteration

_T = TypeVar("_T")


class Accesses:
    """The lookups of one iteration; read them, never change them."""

    def __init__(self, it: Iteration) -> None:
        self.op_ticks = [int(op.tick) for op in it.ops]
        self.op_pos = {t: k for k, t in enumerate(self.op_ticks)}
        self.durations = {int(op.tick): op.duration_ns for op in it.ops}  # as the trace has them
        self.live = live_bytes(it).tolist() if it.ticks else [0]  # transient bytes per tick
        self.reads: dict[int, set[int]] = {}  # op tick -> block ids it reads
        self.writes: dict[int, set[int]] = {}  # op tick -> block ids it writes
        self.written: dict[int, list[int]] = {}  # block id -> ticks writing it, in order
        self.touched: dict[int, list[int]] = {}  # block id -> ticks accessing it, in order
        for a in it.accesses:
            (self.writes if a.write else self.reads).setdefault(a.tick, set()).add(a.block)
            self.touched.setdefault(a.block, []).append(a.tick)
            if a.write:
                self.written.setdefault(a.block, []).append(a.tick)
        for ticks in (*self.touched.values(), *self.written.values()):
            ticks.sort()
        self.index = {b.id: i for i, b in enumerate(it.blocks)}  # block id -> index in blocks
        self.persistent = {pid for pid, _ in it.persistent}
        self.sizes: dict[int, int] = {b.id: int(b.size) for b in it.blocks}
        self.sizes.update((pid, int(size)) for pid, size in it.persistent)
        self._scaled: dict[float, dict[int, int]] = {1.0: self.durations}
        self._derived: dict[Hashable, object] = {}

    def scaled(self, compute_scale: float) -> dict[int, int]:
        """Op tick -> its duration times `compute_scale`, rounded to whole ns."""
        made = self._scaled.get(compute_scale)
        if made is None:
            made = {t: round(ns * compute_scale) for t, ns in self.durations.items()}
            self._scaled[compute_scale] = made
        return made


_KEPT: dict[int, tuple[Iteration, Accesses]] = {}  # by id(it); holding it keeps the id its own
_MOST = 8


def accesses(it: Iteration) -> Accesses:
    """The lookups of `it`, built at its first use."""
    held = _KEPT.get(id(it))
    if held is not None and held[0] is it:
        return held[1]
    made = Accesses(it)
    if len(_KEPT) >= _MOST:
        del _KEPT[next(iter(_KEPT))]
    _KEPT[id(it)] = (it, made)
    return made


def derived(it: Iteration, key: Hashable, make: Callable[[], _T]) -> _T:
    """What `make` derives from `it` under `key`, made once while `it`'s lookups are kept."""
    held = accesses(it)._derived
    if key not in held:
        held[key] = make()
    return cast(_T, held[key])
