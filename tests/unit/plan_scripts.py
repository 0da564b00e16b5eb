"""Arbitrary plans and arbitrary divergence from them, for property tests of the executors
(Python and native) that must stay safe whatever the plan and the program do.

`SLOTS`: a plan's slots as (size in 256-byte units, offset in 256-byte units); slots may share
bytes and overlap in time: the plan is not trusted. `SCRIPT`: actions of the program —
("plan_size", i) allocates slot i's size, ("size", n) n bytes, ("free", k) frees a live block
chosen by k, ("step", 0) an iteration boundary, ("replan", 0) installs the plan again.
"""

from __future__ import annotations

from hypothesis import strategies as st
from tidalclient.plans import PlanTable
from tidalcore.units import align_up

SLOTS = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 7)), min_size=1, max_size=8)
SCRIPT = st.lists(
    st.one_of(
        st.tuples(st.just("plan_size"), st.integers(0, 7)),
        st.tuples(st.just("size"), st.integers(1, 2000)),
        st.tuples(st.just("free"), st.integers(0, 100)),
        st.tuples(st.just("step"), st.just(0)),
        st.tuples(st.just("replan"), st.just(0)),
    ),
    max_size=80,
)


def plans_of(slots: list[tuple[int, int]]) -> tuple[PlanTable, PlanTable]:
    """The plan of `SLOTS` (sizes of whole units, every other one 17 bytes short), and the plan
    a "replan" installs: the same slots in reverse order, plan id 2."""
    sizes = [units * 256 - 17 * (i % 2) for i, (units, _) in enumerate(slots)]
    offsets = [at * 256 for _, at in slots]
    height = max(o + align_up(s, 256) for s, o in zip(sizes, offsets, strict=True))
    return (
        PlanTable.build(1, sizes, offsets, height, alignment=256),
        PlanTable.build(2, sizes[::-1], offsets[::-1], height, alignment=256),
    )
