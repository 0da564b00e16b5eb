"""planner/superneurons: Cost-Aware Recomputation drops the cheap layers' tensors and keeps the
convolution outputs, speed- or memory-centric per segment by the l_peak rule; the Tensor Cache
offloads convolution outputs only while memory is still short; every plan runs and validates."""

from __future__ import annotations

from pathlib import Path

import pytest
from tidalcore.units import Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.learn import extract
from tidalplan.model import Iteration, Recompute, Swap, SwapPlan
from tidalplan.simulate import no_limit, simulate
from tidalplan.superneurons import cache_candidates, checkpoint, recomputations, superneurons
from tidalplan.validate import validate_swaps

from .iterations import build

RESNET = Path(__file__).resolve().parents[3] / "shared/traces/models/resnet50.b32.trace.csv"
CONV = "aten.convolution.default"
CONV_BWD = "aten.convolution_backward.default"
GBPS = 1.0  # 1 byte per ns


def net(w2: int = 100, pool: str = "aten.max_pool2d_with_indices.default") -> Iteration:
    """conv → bn → relu_ → pool → conv, a loss whose gradient T is the peak, then back.

    Blocks in allocation order: 0 X, 1 C1, 2 B, 3 P, 4 C2, 5 G, 6 T, 7 GC2, 8 GP, 9 GB,
    10 GC1, 11 GX; W1 and W2 persistent. Op ticks: forward 2 4 5 7 9, backward from 11:
    13 17 20 23 26 29 33. The peak, X C1 B P C2 G T W1 W2 = 20,210 bytes, is at ticks 12-13.
    """
    return build(
        [
            "a X 1000",  # 0
            "a C1 4000",  # 1
            f"o {CONV} 4000 X W1 >C1",  # 2   checkpoint
            "a B 4000",  # 3
            "o aten.native_batch_norm.default 500 C1 W1 >B",  # 4   cheap
            "o aten.relu_.default 500 B >B",  # 5   cheap, in place
            "a P 1000",  # 6
            f"o {pool} 500 B >P",  # 7   cheap; B's last forward access
            "a C2 2000",  # 8
            f"o {CONV} 4000 P W2 >C2",  # 9   checkpoint; P's last forward access
            "a G 10",  # 10
            "o aten.nll_loss_backward.default 100 C2 >G",  # 11  the split
            "a T 8000",  # 12
            "o aten.mul.Tensor 500 G C2 >T",  # 13
            "f G",  # 14
            "f C2",  # 15
            "a GC2 2000",  # 16
            "o aten.mul.Tensor 500 T >GC2",  # 17
            "f T",  # 18
            "a GP 1000",  # 19
            f"o {CONV_BWD} 4000 P GC2 W2 >GP",  # 20  P's first backward access
            "f GC2",  # 21
            "a GB 4000",  # 22
            "o aten.max_pool2d_with_indices_backward.default 500 GP B >GB",  # 23  B's
            "f GP",  # 24
            "f P",  # 25
            "o aten.threshold_backward.default 500 GB B >GB",  # 26  B's last access
            "f B",  # 27
            "a GC1 4000",  # 28
            "o aten.native_batch_norm_backward.default 500 GB C1 >GC1",  # 29
            "f GB",  # 30
            "f C1",  # 31
            "a GX 1000",  # 32
            f"o {CONV_BWD} 4000 X GC1 W1 >GX",  # 33
            "f GC1",  # 34
            "f GX",  # 35
            "f X",  # 36
        ],
        persistent={"W1": 100, "W2": w2},
    )


NET = net()
C1, B, P, C2 = 1, 2, 3, 4


def rc(block: int, drop_after: int, before: int) -> Recompute:
    return Recompute(block=block, drop_after=Tick(drop_after), before=Tick(before))


def test_checkpoints_are_convolutions_and_fully_connected_layers() -> None:
    assert checkpoint(CONV) and checkpoint("aten.addmm.default") and checkpoint("aten.mm.default")
    for cheap in (
        "aten.relu_.default",
        "aten.native_batch_norm.default",
        "aten.max_pool2d_with_indices.default",
        "aten.add.Tensor",
    ):
        assert not checkpoint(cheap)


def test_speed_centric_drops_the_cheap_layers_and_keeps_the_conv_output() -> None:
    # The segment after the first conv holds B (bn, relu_) and P (pool); its memcost is its
    # bytes, 5,000, plus conv backward's other bytes at op 20 (GC2 W2 GP: 3,100) = 8,100, at
    # most l_peak = 12,000 (op 29: GB C1 GC1): rebuilt once, both at op 20, from C1.
    assert recomputations(NET) == (rc(B, 7, 20), rc(P, 9, 20))
    r = simulate(NET, SwapPlan(recomputes=recomputations(NET)), None, GBPS, GBPS)
    assert (r.peak_bytes, r.recompute_ns, r.recomputed_bytes) == (15_210, 1500, 5000)
    assert no_limit(NET).peak_bytes == 20_210


def test_memory_centric_rebuilds_for_every_backward_layer() -> None:
    # W2 of 10,000 bytes: memcost 5,000 + 13,000 = 18,000 > l_peak = 14,000 (op 20), so B is
    # rebuilt for each op that needs it (20, with P, then 23 and 26) and dropped after each.
    it = net(w2=10_000)
    plan = SwapPlan(recomputes=recomputations(it))
    assert plan.recomputes == (rc(B, 7, 20), rc(P, 9, 20), rc(B, 20, 23), rc(B, 23, 26))
    r = simulate(it, plan, None, GBPS, GBPS)
    assert (r.recompute_ns, r.recomputed_bytes) == (1500 + 1000 + 1000, 13_000)
    validate_swaps(it, plan, r, None, GBPS)


def test_a_layer_that_draws_random_numbers_is_not_recomputed() -> None:
    # P, drawn at random, stays; B alone is rebuilt, at its own first backward access.
    it = net(pool="aten.bernoulli_.float")
    assert recomputations(it) == (rc(B, 7, 23),)


def test_nothing_when_the_iteration_fits() -> None:
    assert superneurons(NET, 20_210, GBPS, GBPS) == SwapPlan()


def test_recomputation_alone_when_it_is_enough() -> None:
    plan = superneurons(NET, 15_210, GBPS, GBPS)
    assert plan == SwapPlan(recomputes=(rc(B, 7, 20), rc(P, 9, 20)))
    r = simulate(NET, plan, 15_210, GBPS, GBPS)
    assert r.feasible and r.iteration_ns == 20_100 + 1500
    validate_swaps(NET, plan, r, 15_210, GBPS)


def test_the_tensor_cache_offloads_conv_outputs_while_memory_is_still_short() -> None:
    # LRU order: C1 (last forward access 4), then C2 (9). C1 comes back before op 20, whose
    # rebuild reads it, not before its own next access at 29; issued at op 17, the op before
    # (no backward convolution comes earlier).
    assert cache_candidates(NET, recomputations(NET)) == (
        Swap(block=C1, out_after=Tick(4), in_before=Tick(20), in_at=Tick(17)),
        Swap(block=C2, out_after=Tick(9), in_before=Tick(11), in_at=Tick(10)),
    )
    plan = superneurons(NET, 15_209, GBPS, GBPS)
    assert plan.swaps == (Swap(block=C1, out_after=Tick(4), in_before=Tick(20), in_at=Tick(17)),)
    assert plan.recomputes == (rc(B, 7, 20), rc(P, 9, 20))
    r = simulate(NET, plan, 15_209, GBPS, GBPS)
    assert r.feasible and r.peak_bytes == 15_200
    validate_swaps(NET, plan, r, 15_209, GBPS)


@pytest.mark.skipif(not RESNET.exists(), reason=f"no trace at {RESNET}")
def test_resnet50_at_six_tenths_of_its_peak() -> None:
    events = read_trace_csv(RESNET)
    it = extract(events, events.marks())
    limit = int(no_limit(it).peak_bytes * 0.6)
    plan = superneurons(it, limit, 12.0, 12.0)
    assert plan.recomputes and plan.swaps
    r = simulate(it, plan, limit, 12.0, 12.0)
    assert r.feasible and r.recompute_ns > 0
    validate_swaps(it, plan, r, limit, 12.0)
