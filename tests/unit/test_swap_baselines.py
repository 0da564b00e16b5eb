"""planner/swap_baselines: the exact swaps vDNN and SuperNeurons choose on a hand-built
two-convolution iteration (vDNN's findPrefetchLayer and vDNN_dyn's profiling passes worked out
by hand), every plan accepted by `simulate`, and the policies on a real trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from tidalcore.units import Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.baselines import (
    BASELINES,
    find_prefetch_layers,
    superneurons_candidates,
    uses,
    vdnn_all,
    vdnn_conv,
    vdnn_dyn,
)
from tidalplan.learn import extract
from tidalplan.model import Swap, SwapPlan
from tidalplan.simulate import no_limit, simulate
from tidalplan.validate import validate_swaps

from .iterations import build

RESNET = Path(__file__).resolve().parents[3] / "shared/traces/models/resnet50.b32.trace.csv"

CONV = "aten.convolution.default"
CONV_BWD = "aten.convolution_backward.default"


# conv → relu → conv → sum, then the loss gradient and back through both convolutions.
# Blocks, in allocation order: 0 X, 1 C1, 2 R, 3 C2, 4 L, 5 G, 6 GC2, 7 GR, 8 GC1, 9 GX.
# Op ticks: forward 2 4 6 8, backward (from the first "backward" op) 10 13 16 20 22 26.
NET = build(
    [
        "a X 1000",  # 0
        "a C1 2000",  # 1
        f"o {CONV} 4000 X >C1",  # 2
        "a R 2000",  # 3
        "o aten.relu.default 1000 C1 >R",  # 4
        "a C2 3000",  # 5
        f"o {CONV} 4000 R >C2",  # 6
        "a L 100",  # 7
        "o aten.sum.default 500 C2 >L",  # 8
        "a G 100",  # 9
        "o aten.nll_loss_backward.default 500 L >G",  # 10  the split
        "f L",  # 11
        "a GC2 3000",  # 12
        "o aten.mul.Tensor 1000 C2 G >GC2",  # 13
        "f G",  # 14
        "a GR 2000",  # 15
        f"o {CONV_BWD} 4000 R GC2 >GR",  # 16
        "f GC2",  # 17
        "f C2",  # 18
        "f R",  # 19
        "o aten.add_.Tensor 500 GR >GR",  # 20
        "a GC1 2000",  # 21
        "o aten.threshold_backward.default 1000 C1 GR >GC1",  # 22
        "f GR",  # 23
        "f C1",  # 24
        "a GX 1000",  # 25
        f"o {CONV_BWD} 4000 X GC1 >GX",  # 26
        "f GC1",  # 27
        "f GX",  # 28
        "f X",  # 29
    ]
)
GBPS = 1.0  # 1 byte per ns: a 2000-byte copy takes 2000 ns


def swap(block: int, out_after: int, in_before: int, in_at: int) -> Swap:
    return Swap(
        block=block, out_after=Tick(out_after), in_before=Tick(in_before), in_at=Tick(in_at)
    )


def test_uses_maps_trace_ids_to_block_indices() -> None:
    u = uses(NET)
    assert u.split == 10
    assert u.conv == {2, 6, 16, 26}
    assert u.ticks[0] == (2, 26)  # X
    assert u.ticks[1] == (2, 4, 22)  # C1
    assert (u.reads[1], u.writes[1]) == (frozenset({4, 22}), frozenset({2}))
    assert u.ticks[7] == (16, 20, 22)  # GR, read and written in place at 20
    assert (u.first(1), u.last(1), u.last_forward(1), u.next_after(1, 4)) == (2, 22, 4, 22)
    assert u.last_forward(5) is None  # G lives in backward only


def test_find_prefetch_layer_searches_up_to_the_next_convolution() -> None:
    # NET's backward layers 10 13 16 20 22 26, convolutions 16 and 26. Every layer offloaded:
    # each is prefetched from the layer before it, except 26: at 20 the search passes 22
    # (prefetched from 16, not a convolution) and reaches it.
    backward = [Tick(t) for t in (10, 13, 16, 20, 22, 26)]
    conv = {Tick(16), Tick(26)}
    every = {Tick(t) for t in (13, 16, 22, 26)}
    assert find_prefetch_layers(backward, every, conv) == {13: 10, 16: 13, 22: 16, 26: 20}
    # Convolutions only: from 10 the search passes 13 and stops at 16, itself offloaded; from
    # 13 it stops at 16, prefetched already; 26 is found from 16, the previous convolution.
    assert find_prefetch_layers(backward, {Tick(16), Tick(26)}, conv) == {16: 10, 26: 16}
    # A convolution that offloaded nothing ends the search: 4 waits until the search starts at
    # 3, past the convolutions 2 and 3; the first layer's own inputs are never searched for.
    ticks = [Tick(t) for t in (1, 2, 3, 4, 5)]
    got = find_prefetch_layers(ticks, {ticks[0], ticks[3], ticks[4]}, {ticks[1], ticks[2]})
    assert got == {4: 3, 5: 4}


def test_vdnn_all_offloads_every_forward_input_needed_in_backward() -> None:
    # L is written in forward but first read in backward: no forward op reads it. C2 (needed
    # at 13) is prefetched at 10, R (16) at 13, C1 (22) at the backward convolution 16 and X
    # (26) at 20, the first layer whose search reaches 26 past the prefetched 22.
    assert vdnn_all(NET) == SwapPlan(
        (swap(0, 2, 26, 20), swap(1, 4, 22, 16), swap(2, 6, 16, 13), swap(3, 8, 13, 10))
    )


def test_vdnn_conv_prefetches_at_the_previous_convolution() -> None:
    # X, read by the first convolution and needed at 26, is prefetched at the backward
    # convolution 16, not at 22 or 20 (one op ahead); R, with no convolution between the
    # first backward layer and its use at 16, is prefetched at 10, the first backward layer.
    assert vdnn_conv(NET) == SwapPlan((swap(0, 2, 26, 16), swap(2, 6, 16, 10)))
    r = simulate(NET, vdnn_conv(NET), PEAK_CONV, GBPS, GBPS)
    assert r.feasible
    validate_swaps(NET, vdnn_conv(NET), r, PEAK_CONV, GBPS)
    assert (r.iteration_ns, r.stall_ns) == (22500, 2000)


def test_inputs_of_the_first_backward_layer_stay_resident() -> None:
    # Y is read in forward (relu at 4) and next needed by the first backward op (5): no
    # layer's search reaches it, and vDNN does not copy back on demand, so it is not offloaded.
    it = build(
        [
            "a X 10",
            "a Y 10",
            f"o {CONV} 100 X >Y",
            "a L 10",
            "o aten.relu.default 100 Y >L",
            "o aten.nll_loss_backward.default 100 L Y",
            f"o {CONV_BWD} 100 X",
            "f L",
            "f Y",
            "f X",
        ]
    )
    assert vdnn_all(it) == vdnn_conv(it) == SwapPlan((swap(0, 2, 6, 5),))


def test_superneurons_candidates_are_conv_outputs_in_lru_order() -> None:
    # C1 is prefetched at the backward convolution 16, one convolution ahead of its use at 22
    # (not at 20, the op before); no backward convolution precedes C2's use at 13: op 10.
    assert superneurons_candidates(NET) == (swap(1, 4, 22, 16), swap(3, 8, 13, 10))


def test_no_backward_op_means_nothing_to_offload() -> None:
    forward = build(["a X 10", f"o {CONV} 100 X", "o aten.relu.default 100 X", "f X"])
    assert uses(forward).split == 4
    assert vdnn_all(forward) == vdnn_conv(forward) == SwapPlan()
    assert superneurons_candidates(forward) == ()


# The no-limit peak is 13000 bytes at tick 15 (X C1 R C2 GC2 GR live); 20500 ns of ops.
PEAK = 13000
PEAK_CONV = 12000  # X and R away: the lowest limit vDNN_conv's simulation fits
PEAK_ALL = 10000  # X, C1, R and C2 away


def test_static_plans_lower_the_peak_and_cost_time() -> None:
    base = no_limit(NET)
    assert (base.peak_bytes, base.iteration_ns) == (PEAK, 20500)
    r_conv = simulate(NET, vdnn_conv(NET), None, GBPS, GBPS)
    r_all = simulate(NET, vdnn_all(NET), None, GBPS, GBPS)
    # With no limit the early prefetches come back at once: R at 10 while GC2 is allocated
    # at 12 brings vDNN_conv back to the peak; under a limit the swap-ins wait for room.
    assert (r_conv.feasible, r_conv.peak_bytes, r_conv.iteration_ns) == (True, PEAK, 22500)
    assert (r_all.feasible, r_all.peak_bytes, r_all.iteration_ns) == (True, PEAK_CONV, 28500)
    assert simulate(NET, vdnn_conv(NET), PEAK_CONV, GBPS, GBPS).feasible
    assert not simulate(NET, vdnn_conv(NET), PEAK_CONV - 1, GBPS, GBPS).feasible
    assert simulate(NET, vdnn_all(NET), PEAK_ALL, GBPS, GBPS).feasible
    assert not simulate(NET, vdnn_all(NET), PEAK_ALL - 1, GBPS, GBPS).feasible


@pytest.mark.parametrize(
    ("limit", "chosen"),
    [
        (PEAK, "none"),  # fits as it is
        (PEAK_CONV, "conv"),  # both swap plans fit; conv is cheaper (22500 ns against 30000)
        (PEAK_ALL, "all"),  # only vDNN_all fits
        (PEAK_ALL - 1, "all"),  # pass 1 fails: vDNN_all, infeasible in simulate
    ],
)
def test_vdnn_dyn_takes_the_first_pass_that_fits(limit: int, chosen: str) -> None:
    plans = {"none": SwapPlan(), "conv": vdnn_conv(NET), "all": vdnn_all(NET)}
    assert vdnn_dyn(NET, limit, GBPS, GBPS) == plans[chosen]
    r = simulate(NET, plans[chosen], limit, GBPS, GBPS)
    assert r.feasible == (limit >= PEAK_ALL)
    if r.feasible:
        validate_swaps(NET, plans[chosen], r, limit, GBPS)


# P (read by a forward relu at 1) and X (by the convolution at 4) are needed again at 11 and 9;
# M's malloc at 5 needs one of them away under a limit of 200 bytes. vDNN_conv waits there for
# X's swap-out (100 ns); vDNN_all has had P away since 110 ns and does not wait.
DYN = build(
    [
        "a P 100",
        "o aten.relu.default 10 P",
        "o aten.relu.default 1000",
        "a X 100",
        f"o {CONV} 10 X",
        "a M 100",
        "o aten.sum.default 10 M",
        "f M",
        "o aten.nll_loss_backward.default 1000",
        f"o {CONV_BWD} 10 X",
        "o aten.threshold_backward.default 1000",
        "o aten.threshold_backward.default 10 P",
        "f X",
        "f P",
    ]
)


def test_vdnn_dyn_adopts_vdnn_conv_once_it_passes_even_where_vdnn_all_is_faster() -> None:
    assert vdnn_conv(DYN) == SwapPlan((swap(1, 4, 9, 8),))
    assert vdnn_all(DYN) == SwapPlan((swap(0, 1, 11, 9), swap(1, 4, 9, 8)))
    got = {
        name: simulate(DYN, p, 200, GBPS, GBPS)
        for name, p in (("none", SwapPlan()), ("conv", vdnn_conv(DYN)), ("all", vdnn_all(DYN)))
    }
    assert not got["none"].feasible
    assert (got["conv"].feasible, got["conv"].stall_ns, got["conv"].iteration_ns) == (
        True,
        100,
        3150,
    )
    assert (got["all"].feasible, got["all"].stall_ns, got["all"].iteration_ns) == (True, 0, 3050)
    assert vdnn_dyn(DYN, 200, GBPS, GBPS) == vdnn_conv(DYN)
    validate_swaps(DYN, vdnn_conv(DYN), got["conv"], 200, GBPS)
    validate_swaps(DYN, vdnn_all(DYN), got["all"], 200, GBPS)


C1_OUT = swap(1, 4, 22, 16)
C2_OUT = swap(3, 8, 13, 10)


def test_registry_names_and_uniform_signature() -> None:
    assert sorted(BASELINES) == ["vdnn-all", "vdnn-conv", "vdnn-dyn"]
    assert BASELINES["vdnn-all"](NET, 0, GBPS, GBPS) == vdnn_all(NET)
    assert BASELINES["vdnn-conv"](NET, 0, GBPS, GBPS) == vdnn_conv(NET)
    assert BASELINES["vdnn-dyn"](NET, PEAK_CONV, GBPS, GBPS) == vdnn_conv(NET)


@pytest.mark.skipif(not RESNET.exists(), reason=f"no trace at {RESNET}")
def test_resnet50_plans_validate() -> None:
    events = read_trace_csv(RESNET)
    it = extract(events, events.marks())
    base = no_limit(it)
    limit = int(0.8 * base.peak_bytes)
    for name, policy in BASELINES.items():
        plan = policy(it, limit, 12.0, 12.0)
        assert plan.swaps, name
        simulate(it, plan, None, 12.0, 12.0)  # raises ValueError on a plan it refuses
    r_all = simulate(it, vdnn_all(it), None, 12.0, 12.0)
    assert r_all.feasible and r_all.peak_bytes < base.peak_bytes
