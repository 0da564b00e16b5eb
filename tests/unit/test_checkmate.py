"""planner/checkmate: the recomputation-only integer program. On small iterations it is
checked against every recomputation plan run through `simulate`; on real traces, that its
plans run, pass the validator, and come within the limit."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from tidalcore.units import Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.autoswap import load
from tidalplan.checkmate import Remat, checkmate, solve
from tidalplan.learn import extract
from tidalplan.model import Iteration, Recompute, SwapPlan
from tidalplan.simulate import Result, no_limit, simulate
from tidalplan.validate import validate_swaps

from ..conftest import shared_file
from .iterations import TWO_LAYERS, build

GBPS = 12.0

# Two layers forward, a loss, two backward (`iterations.TWO_LAYERS`). Blocks: 0 X, 1 A, 2 B,
# 3 L, 4 GB, 5 GA; W persistent. The peak, 13,110 bytes, is at ticks 7 and 8.
NET = TWO_LAYERS
# The same, fwd1 also writing S (freed at once): rebuilding A needs S's bytes as scratch.
SCRATCH = [*NET[:2], "a S 500", "o fwd1 1000 X W >A >S", "f S", *NET[3:]]
# A chain: B's writer reads A. At the peak (tick 10: X A B D C T, 25,000 bytes) two of A, B
# and D must be away for a limit of 17,000; D's writer is dear (5000 ns). Dropping A and B
# and rebuilding both for op 14 (fwd1 then fwd2, 200 ns) is the optimum: B alone cannot be
# rebuilt there while A is away, and any plan with D costs its 5000 ns.
CHAIN = [
    "a X 1000",  # 0
    "a A 4000",  # 1
    "o fwd1 100 X >A",  # 2
    "a B 4000",  # 3
    "o fwd2 100 A >B",  # 4   A's last forward access
    "a D 4000",  # 5
    "o fwd3 5000 X >D",  # 6
    "a C 4000",  # 7
    "o fwd4 1000 B D >C",  # 8   B's and D's last forward access
    "a T 8000",  # 9
    "o big 1000 C >T",  # 10  the peak
    "f T",  # 11
    "f C",  # 12
    "a G 4000",  # 13
    "o bwd2 100 B >G",  # 14  B needed again
    "o bwd1 100 A G",  # 15  A needed again
    "o bwd3 100 D G",  # 16  D needed again
    "f G",  # 17
    "f D",  # 18
    "f B",  # 19
    "f A",  # 20
    "f X",  # 21
]
# An in-place op: relu rewrites A where it lies, so A's writers are fwd1 and relu, and
# rebuilding A runs both.
INPLACE = [*NET[:3], "o relu 300 A >A", *NET[3:]]
SMALL = {
    "net": build(NET, persistent={"W": 100}),
    "scratch": build(SCRATCH, persistent={"W": 100}),
    "chain": build(CHAIN),
    "inplace": build(INPLACE, persistent={"W": 100}),
}


def every_plan(it: Iteration) -> Iterator[SwapPlan]:
    """Every recomputation-only plan that drops a block right after an access: per gap between
    two consecutive accesses of a transient block, nothing, or a drop after the first rebuilt
    before any op up to the second. (Dropping later in the gap keeps the block longer for the
    same rebuild; a plan whose rebuild cannot run is refused by `simulate`.)"""
    accesses: dict[int, list[int]] = {}
    for acc in it.accesses:
        accesses.setdefault(acc.block, []).append(acc.tick)
    ops = [op.tick for op in it.ops]
    choices: list[list[Recompute | None]] = []
    for i, b in enumerate(it.blocks):
        mine = sorted({t for t in accesses.get(b.id, ()) if b.start < t < b.end})
        for a, c in itertools.pairwise(mine):
            choices.append([None, *(Recompute(i, Tick(a), u) for u in ops if a < u <= c)])
    for pick in itertools.product(*choices):
        yield SwapPlan(recomputes=tuple(r for r in pick if r is not None))


def best_time(it: Iteration, limit: int) -> int | None:
    """The least simulated iteration time over `every_plan`; None if none is feasible."""
    best: int | None = None
    for plan in every_plan(it):
        try:
            r = simulate(it, plan, limit, GBPS, GBPS)
        except ValueError:
            continue
        if r.feasible and (best is None or r.iteration_ns < best):
            best = r.iteration_ns
    return best


def run(it: Iteration, plan: SwapPlan, limit: int) -> Result:
    """Simulate a plan of checkmate's (a ValueError is a malformed plan); validate it when
    feasible; no swaps, ever."""
    assert plan.swaps == ()
    r = simulate(it, plan, limit, GBPS, GBPS)
    if r.feasible:
        validate_swaps(it, plan, r, limit, GBPS)
        assert r.iteration_ns == r.baseline_ns + r.recompute_ns  # nothing waits
    return r


def limits(it: Iteration) -> list[int]:
    """The limits where the best time can change, high to low: each plan's peak with no limit
    (where it starts to fit) and a byte under it."""
    peaks: set[int] = set()
    for plan in every_plan(it):
        try:
            peaks.add(simulate(it, plan, None, GBPS, GBPS).peak_bytes)
        except ValueError:
            continue
    return sorted({p - d for p in peaks for d in (0, 1)}, reverse=True)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_least_time_of_every_recomputation_plan(name: str) -> None:
    it = SMALL[name]
    seen = {"optimal": 0, "infeasible": 0}
    every = limits(it)
    for limit in every:
        best = best_time(it, limit)
        found = solve(it, limit, GBPS, GBPS)
        r = run(it, found.plan, limit)
        assert found.exhaustive
        if best is None:
            assert (found.status, found.plan, r.feasible) == ("infeasible", SwapPlan(), False)
        else:
            assert found.status == "optimal" and r.feasible, limit
            assert r.iteration_ns == best, limit
            assert found.recompute_ns == r.recompute_ns
        seen[found.status] += 1
        # The restricted program (rebuilds at the next access, and for a chain) never does
        # better, and its plans run too.
        restricted = solve(it, limit, GBPS, GBPS, full_up_to=0)
        assert restricted.exhaustive == (limit >= load(it).max())  # nothing to do at the peak
        q = run(it, restricted.plan, limit)
        assert not q.feasible or (best is not None and q.iteration_ns >= best)
    assert seen["optimal"] >= 3 and seen["infeasible"] >= 1  # the limits span both


def test_nothing_to_do_under_the_peak() -> None:
    it = SMALL["net"]
    found = solve(it, 13_110, GBPS, GBPS)
    assert (found.plan, found.status, found.recompute_ns) == (SwapPlan(), "optimal", 0)


def test_net_drops_a_over_the_peak_and_rebuilds_it_for_its_backward() -> None:
    it = SMALL["net"]
    plan = checkmate(it, 13_100, GBPS, GBPS)
    assert plan == SwapPlan(recomputes=(Recompute(block=1, drop_after=Tick(4), before=Tick(12)),))
    assert run(it, plan, 13_100).iteration_ns == 6100 + 1000


def test_the_scratch_of_a_rebuilt_op_counts() -> None:
    # A byte under the peak, A must be away over it and back only for op 12 (14 with S): in
    # NET that takes 13,100 bytes there; with S's 500 bytes of scratch beside it, 13,600.
    limit = 13_109
    assert checkmate(SMALL["net"], limit, GBPS, GBPS) == SwapPlan(
        recomputes=(Recompute(block=1, drop_after=Tick(4), before=Tick(12)),)
    )
    it = SMALL["scratch"]
    found = solve(it, limit, GBPS, GBPS)
    assert (found.status, found.plan) == ("infeasible", SwapPlan())
    blind = SwapPlan(recomputes=(Recompute(block=1, drop_after=Tick(6), before=Tick(14)),))
    assert simulate(it, blind, None, GBPS, GBPS).peak_bytes == 13_600
    assert not simulate(it, blind, limit, GBPS, GBPS).feasible
    assert solve(it, 13_600, GBPS, GBPS).plan == SwapPlan()  # over the peak: nothing to do


@pytest.mark.parametrize("full_up_to", [10_000, 0], ids=["every-op", "restricted"])
def test_a_chain_is_rebuilt_in_one_rebuild(full_up_to: int) -> None:
    it = SMALL["chain"]
    found = solve(it, 17_000, GBPS, GBPS, full_up_to=full_up_to)
    assert found.status == "optimal"
    assert found.plan == SwapPlan(
        recomputes=(
            Recompute(block=1, drop_after=Tick(4), before=Tick(14)),
            Recompute(block=2, drop_after=Tick(8), before=Tick(14)),
        )
    )
    r = run(it, found.plan, 17_000)
    assert r.feasible and r.recompute_ns == found.recompute_ns == 200
    assert r.iteration_ns == no_limit(it).baseline_ns + 200 == best_time(it, 17_000)
    assert r.rebuild_ns[0] == r.rebuild_ns[1]  # one rebuild


def test_without_any_plan_the_plan_is_empty() -> None:
    it = SMALL["chain"]
    found = solve(it, 12_000, GBPS, GBPS)  # C, T and X alone are 13,000 at the peak
    assert (found.status, found.plan) == ("infeasible", SwapPlan())
    assert not run(it, found.plan, 12_000).feasible


def _trace(name: str) -> Iteration:
    events = read_trace_csv(shared_file(f"traces/models/{name}.trace.csv"))
    return extract(events, events.marks())


def least_device_bytes(it: Iteration) -> int:
    """A bound that shares no code with the program: the device bytes no recomputation-only
    plan can go below. A block can be away at tick t only if it is live there, not accessed
    there, written before, and some op after t (up to its next access) could run its writers
    again with every block they read live."""
    accessed: dict[int, list[tuple[int, bool]]] = {}
    reads: dict[int, set[int]] = {}
    for acc in it.accesses:
        accessed.setdefault(acc.block, []).append((acc.tick, acc.write))
        if not acc.write:
            reads.setdefault(acc.tick, set()).add(acc.block)
    lifetime = {b.id: (b.start, b.end) for b in it.blocks}
    persistent = {pid for pid, _ in it.persistent}
    ops = [op.tick for op in it.ops]

    def live(pid: int, u: int) -> bool:
        start, end = lifetime.get(pid, (0, 0))
        return pid in persistent or start < u < end

    worst = 0
    device = load(it)
    for t in range(it.ticks):
        away = 0
        for b in it.blocks:
            mine = [(u, w) for u, w in accessed.get(b.id, ()) if b.start < u < b.end]
            if not b.start < t < b.end or any(u == t for u, _ in mine):
                continue
            writers = [u for u, w in mine if w and u < t]
            after = min((u for u, _ in mine if u > t), default=b.end - 1)
            if writers and any(
                all(live(p, u) or p == b.id for w in writers for p in reads.get(w, ()))
                for u in ops
                if t < u <= after
            ):
                away += b.size
        worst = max(worst, int(device[t]) - away)
    return worst


def test_vgg16_at_0_8_of_its_peak_has_no_recomputation_plan() -> None:
    # Backward through the first convolution needs four 411 MB activations at once; the
    # weights' gradients, live beside them, cannot be rebuilt (their writers' inputs are
    # freed). No recomputation-only plan reaches 0.8 of the peak (0.92 is the floor).
    it = _trace("vgg16.b32")
    limit = int(int(load(it).max()) * 0.8)
    assert least_device_bytes(it) > limit
    found = solve(it, limit, GBPS, GBPS)
    assert (found.status, found.plan) == ("infeasible", SwapPlan())
    assert not run(it, found.plan, limit).feasible


@pytest.mark.parametrize(
    ("name", "fraction", "recompute_ns"),
    [("vgg16.b32", 0.95, 215_796), ("resnet50.b32", 0.8, 301_728)],
)
def test_real_traces(name: str, fraction: float, recompute_ns: int) -> None:
    it = _trace(name)
    limit = int(int(load(it).max()) * fraction)
    assert not simulate(it, SwapPlan(), limit, GBPS, GBPS).feasible
    found = solve(it, limit, GBPS, GBPS)
    r = run(it, found.plan, limit)
    assert r.feasible and found.status == "optimal"
    assert r.recompute_ns == found.recompute_ns == recompute_ns
    assert found.bound_ns == pytest.approx(recompute_ns, abs=1.0)


def test_the_node_limit_makes_the_same_plan_twice() -> None:
    # At 0.6 of resnet50's peak the search stops at its node limit, not proven optimal; the
    # clock is no part of it when it has time enough.
    it = _trace("resnet50.b32")
    limit = int(int(load(it).max()) * 0.6)
    first: Remat = solve(it, limit, GBPS, GBPS, time_limit_s=120.0)
    second = solve(it, limit, GBPS, GBPS, time_limit_s=120.0)
    assert first.status == "limit" and first.bound_ns <= first.recompute_ns
    assert (first.plan, first.recompute_ns) == (second.plan, second.recompute_ns)
    assert run(it, first.plan, limit).feasible
