"""A swap plan's swap-ins are issued at ops, as a client can issue them, and sessions' copies
are planned at the bandwidth they will have."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tidalcore.planupdate import ScheduledSwap
from tidalcore.units import Tick
from tidalplan.model import Swap, SwapPlan
from tidalplan.wire import on_ops
from tidalpoold.plan_worker import DEFAULT_COPY_GBPS, PlanWorker, copy_gbps_of
from tidalpoold.settings import Settings

from .iterations import build

# ticks: 0 a A | 1 op0 A | 2 a B | 3 op1 B | 4 op2 | 5 f B | 6 op3 | 7 op4 A W | 8 f A
IT = build(
    ["a A 100", "o 10 >A", "a B 50", "o 10 >B", "o 10", "f B", "o 10", "o 10 A W", "f A"],
    {"V": 8, "W": 20},
)


def test_swap_ins_are_issued_at_the_op_the_client_can_issue_them_at() -> None:
    swaps = SwapPlan(
        (
            Swap(block=0, out_after=Tick(1), in_before=Tick(7)),  # default: issued at op3
            Swap(block=0, out_after=Tick(1), in_before=Tick(7), in_at=Tick(5)),  # the op after
            Swap(block=1, out_after=Tick(7), in_before=Tick(1), persistent=True),  # W, crossing
        )
    )
    ticks = [op.tick for op in IT.ops]
    rounded = on_ops(IT, swaps)
    assert [ticks.index(s.in_at) for s in rounded.swaps] == [3, 3, 0]
    for s in rounded.swaps:  # the client accepts them, in op indices
        out_after, in_before = ticks.index(s.out_after), ticks.index(s.in_before)
        ScheduledSwap(s.block, out_after, in_before, ticks.index(s.in_at), s.persistent).check()


def test_default_issue_is_never_before_the_op_after_the_swap_out() -> None:
    (swap,) = on_ops(IT, SwapPlan((Swap(block=1, out_after=Tick(3), in_before=Tick(4)),))).swaps
    assert swap.in_at == 4  # op2, the op it is needed by: op1 (tick 3) is the swap-out's


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
        FactsBackend(device="sim (memfd chunks)"),  # no bandwidth facts at all
        FactsBackend(h2d_gbps=0.0, d2h_gbps=0.0),  # sim or cuda, probe skipped
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
