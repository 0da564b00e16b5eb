"""What an iteration asks of the device, tick by tick: the bytes it holds with no swaps (its
load), the time each tick takes, the most bytes one op needs at once (the op-wise bound), and
the host bytes a schedule's swapped-out blocks hold at their peak.

Every planner reads these (AutoSwap's candidates, the search's gaps, the step bound, the
split of big ops); they live here so that none of them imports another's policy for them.
"""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt
from tidalcore.units import align_up

from tidalplan.learn import live_bytes
from tidalplan.model import Iteration, SwapPlan


def load(it: Iteration) -> npt.NDArray[np.int64]:
    """Device bytes at each tick with no swaps: persistent bytes plus transient live bytes."""
    return live_bytes(it) + sum(size for _, size in it.persistent)


def durations(it: Iteration) -> npt.NDArray[np.int64]:
    """ns spent at each tick: the op's duration, 0 for allocs and frees."""
    d = np.zeros(it.ticks, np.int64)
    for op in it.ops:
        d[op.tick] = op.duration_ns
    return d


def op_bound(it: Iteration) -> int:
    """SuperNeurons' op-wise lower bound max(l_i): the most bytes any single op touches (the
    distinct blocks it reads or writes, persistent ones included). No swap plan can keep an
    op's blocks on the device with less."""
    sizes = {b.id: b.size for b in it.blocks}
    sizes.update(it.persistent)
    touched: dict[int, set[int]] = {}
    for a in it.accesses:
        touched.setdefault(a.tick, set()).add(a.block)
    return max((sum(sizes.get(b, 0) for b in bs) for bs in touched.values()), default=0)


def host_peak(it: Iteration, plan: SwapPlan, unit: int) -> int:
    """The most bytes `plan`'s swapped-out blocks hold in the host lease at once, each
    rounded up to `unit` (a session's page under virtual residency, else its alignment): from
    op `out_after` (its copy out starts when that op ends) until op `in_before` (its copy in
    is done by then), over the iteration's end for a persistent block that crosses it."""
    delta = [0] * (it.ticks + 1)
    for s in plan.swaps:
        block = it.persistent[s.block][1] if s.persistent else it.blocks[s.block].size
        size = align_up(block, unit)
        spans = (
            [(s.out_after, s.in_before)]
            if s.in_before > s.out_after
            else [(s.out_after, it.ticks), (0, s.in_before)]
        )
        for lo, hi in spans:
            delta[lo] += size
            delta[hi] -= size
    return max(itertools.accumulate(delta), default=0)
