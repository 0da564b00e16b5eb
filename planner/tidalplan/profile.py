"""What an iteration asks of the device, tick by tick: the bytes it holds with no swaps (its
load), the time each tick takes, and the most bytes one op needs at once (the op-wise bound).

Every planner reads these (AutoSwap's candidates, the search's gaps, the step bound, the
split of big ops); they live here so that none of them imports another's policy for them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tidalplan.learn import live_bytes
from tidalplan.model import Iteration


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
