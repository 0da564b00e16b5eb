"""planner/capuchin: at the peak, the tensor whose free time hides its copies is swapped, with
its swap-in issued at the in-trigger that makes it arrive just in time; one whose copies cannot
be hidden but whose writer is cheap is recomputed; one whose writer cannot run again is
swapped; every plan runs and validates."""

from __future__ import annotations

from pathlib import Path

import pytest
from tidalcore.units import Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.capuchin import capuchin
from tidalplan.learn import extract
from tidalplan.model import Iteration, Recompute, Swap, SwapPlan
from tidalplan.simulate import no_limit, simulate
from tidalplan.validate import validate_swaps

from .iterations import build

RESNET = Path(__file__).resolve().parents[3] / "shared/traces/models/resnet50.b32.trace.csv"
GBPS = 1.0  # 1 byte per ns: a 3000-byte copy takes 3000 ns


def net(
    writer: str = "o fR 100 X >R", before: tuple[str, ...] = (), after: tuple[str, ...] = ()
) -> Iteration:
    """A, written early, waits long for its back-access; R, written just before the peak (Y),
    is needed right after it. Blocks: 0 X, 1 A, 2 R, 3 Y (with `before`, its blocks come
    between A and R); W persistent. Times with no limit (ns):

        op     fA   a1    mid   fR    big   b2    b3    b4
        tick   2    3     4     6     8     10    11    12
        start  0    500   1500  4500  4600  6600  8600  11600

    The peak, X A R Y W = 12,100 bytes, holds from the alloc of Y (tick 7) to op 8.
    A: evicted after op 3 (ends 1500), back at op 12 (11600): FT = 11600 - 3000 - (1500 +
    3000) = 4100 >= 0, and its swap-out ends at 4500, before the peak (4600).
    R: evicted after op 6 (ends 4600), back at op 10 (6600): FT = 6600 - 3000 - (4600 +
    3000) = -4000; its writer fR takes 100 ns.
    """
    return build(
        [
            "a X 1000",
            "a A 3000",
            "o fA 500 X >A",
            "o a1 1000 A",
            "o mid 3000 X",
            "a R 3000",
            *before,
            writer,
            *after,
            "a Y 5000",
            "o big 2000 X >Y",
            "f Y",
            "o b2 2000 R",
            "o b3 3000 X",
            "o b4 1000 A",
            "f R",
            "f A",
            "f X",
        ],
        persistent={"W": 100},
    )


NET = net()
A, R = 1, 2
SWAP_A = Swap(block=A, out_after=Tick(3), in_before=Tick(12), in_at=Tick(11))


def test_nothing_when_the_iteration_fits() -> None:
    assert no_limit(NET).peak_bytes == 12_100
    assert capuchin(NET, 12_100, GBPS, GBPS) == SwapPlan()


def test_the_tensor_with_the_longest_free_time_is_swapped_first() -> None:
    # 3,000 bytes to save: A alone. Its swap-in must start by 11600 - 3000 = 8600 ns: the
    # in-trigger is op 11, which starts then.
    plan = capuchin(NET, 9100, GBPS, GBPS)
    assert plan == SwapPlan((SWAP_A,))
    r = simulate(NET, plan, 9100, GBPS, GBPS)
    assert r.feasible and r.iteration_ns == 12_600 and r.stall_ns == 0
    validate_swaps(NET, plan, r, 9100, GBPS)


def test_a_short_gap_with_a_cheap_writer_is_recomputed() -> None:
    # 4,000 bytes to save: A, then R. R's copies cannot be hidden (swap overhead: 4000 ns of
    # negative free time and 3000 ns before its swap-out frees the peak), its writer takes
    # 100 ns: R is dropped after op 6 and fR runs again before op 10.
    plan = capuchin(NET, 8100, GBPS, GBPS)
    assert plan == SwapPlan((SWAP_A,), (Recompute(block=R, drop_after=Tick(6), before=Tick(10)),))
    r = simulate(NET, plan, 8100, GBPS, GBPS)
    assert r.feasible and r.iteration_ns == 12_600 + 100 and r.recompute_ns == 100
    assert r.peak_bytes == 7100  # X R A W while A comes back
    validate_swaps(NET, plan, r, 8100, GBPS)


def test_a_tensor_whose_writer_cannot_run_again_is_swapped() -> None:
    # fR reads Z, freed right after it: R cannot be rebuilt at its back-access (op 12 here,
    # every tick after A moves up by 2), so it is swapped.
    it = net("o fR 100 Z >R", before=("a Z 10",), after=("f Z",))
    plan = capuchin(it, 8100, GBPS, GBPS)
    assert plan.recomputes == ()
    assert Swap(block=R, out_after=Tick(7), in_before=Tick(12), in_at=Tick(10)) in plan.swaps
    r = simulate(it, plan, 8100, GBPS, GBPS)
    assert r.feasible
    validate_swaps(it, plan, r, 8100, GBPS)


@pytest.mark.skipif(not RESNET.exists(), reason=f"no trace at {RESNET}")
def test_resnet50_at_six_tenths_of_its_peak() -> None:
    events = read_trace_csv(RESNET)
    it = extract(events, events.marks())
    limit = int(no_limit(it).peak_bytes * 0.6)
    plan = capuchin(it, limit, 12.0, 12.0)
    assert plan.recomputes and plan.swaps
    r = simulate(it, plan, limit, 12.0, 12.0)
    assert r.feasible and r.recompute_ns > 0
    validate_swaps(it, plan, r, limit, 12.0)
