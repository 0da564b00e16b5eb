"""A swap plan in ticks becomes PlanUpdate columns in op and allocation indices, and the client
turns those columns back into the schedule its executor runs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tidalclient.plans import ScheduledSwap
from tidalcore.units import Tick
from tidalcore.v1 import pool_pb2
from tidalplan.model import Swap, SwapPlan
from tidalpoold.plan_worker import DEFAULT_COPY_GBPS, PlanWorker, add_swaps, copy_gbps_of
from tidalpoold.settings import Settings

from .iterations import build

# ticks: 0 a A | 1 op0 A | 2 a B | 3 op1 B | 4 op2 | 5 f B | 6 op3 | 7 op4 A W | 8 f A
IT = build(
    ["a A 100", "o 10 >A", "a B 50", "o 10 >B", "o 10", "f B", "o 10", "o 10 A W", "f A"],
    {"V": 8, "W": 20},
)


def columns(plan: pool_pb2.PlanUpdate) -> list[tuple[int, bool, int, int, int]]:
    return list(
        zip(
            plan.swap_blocks,
            plan.swap_persistent,
            plan.swap_out_after,
            plan.swap_in_at,
            plan.swap_in_before,
            strict=True,
        )
    )


def test_ticks_become_op_indices_and_blocks_allocation_indices() -> None:
    plan = pool_pb2.PlanUpdate()
    swaps = SwapPlan(
        (
            Swap(block=0, out_after=Tick(1), in_before=Tick(7)),  # default: issued at op3
            Swap(block=0, out_after=Tick(1), in_before=Tick(7), in_at=Tick(5)),  # the op after
            Swap(block=1, out_after=Tick(7), in_before=Tick(1), persistent=True),  # W, crossing
        )
    )
    add_swaps(plan, IT, swaps)
    # A is allocation 0; W is persistent block 1, trace id 2 (V is 1)
    assert columns(plan) == [(0, False, 0, 3, 4), (0, False, 0, 3, 4), (2, True, 4, 0, 0)]
    for block, persistent, out_after, in_at, in_before in columns(plan):  # the client accepts them
        ScheduledSwap(block, out_after, in_before, in_at, persistent).check()


def test_default_issue_is_never_before_the_op_after_the_swap_out() -> None:
    plan = pool_pb2.PlanUpdate()
    add_swaps(plan, IT, SwapPlan((Swap(block=1, out_after=Tick(3), in_before=Tick(4)),)))
    assert columns(plan) == [(1, False, 1, 2, 2)]


class FactsBackend:
    """A backend as the planner sees it: its facts only."""

    def __init__(self, **facts: str | int | float) -> None:
        self._facts = facts

    def facts(self) -> dict[str, str | int | float]:
        return self._facts


def test_unthrottled_sessions_are_planned_at_the_backends_slower_copy_direction(
    tmp_path: Path,
) -> None:
    cuda = FactsBackend(device="H100", h2d_gbps=25.5, d2h_gbps=21.25)
    assert copy_gbps_of(cuda) == 21.25  # type: ignore[arg-type]
    for no_measure in (
        FactsBackend(device="sim (memfd chunks)"),  # sim
        FactsBackend(h2d_gbps=0.0, d2h_gbps=0.0),  # cuda, probe skipped
        FactsBackend(h2d_gbps=25.0),
        FactsBackend(h2d_gbps="n/a", d2h_gbps=20.0),
        FactsBackend(h2d_gbps=float("nan"), d2h_gbps=20.0),
    ):
        assert copy_gbps_of(no_measure) == DEFAULT_COPY_GBPS == 12.0  # type: ignore[arg-type]
    planner = PlanWorker(Settings(plan_cache_dir=tmp_path), copy_gbps=copy_gbps_of(cuda))  # type: ignore[arg-type]
    try:
        assert planner.swap_gbps(SimpleNamespace(copy_gbps=0.0)) == 21.25  # type: ignore[arg-type]
        assert planner.swap_gbps(SimpleNamespace(copy_gbps=3.0)) == 3.0  # type: ignore[arg-type]
        assert PlanWorker(Settings(plan_cache_dir=tmp_path)).copy_gbps == DEFAULT_COPY_GBPS
    finally:
        planner.close()
