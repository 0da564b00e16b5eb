"""Every swap policy by name, one signature: `plan(it, policy, limit, out_gbps, in_gbps)`.

    policy            what it is                                   module
    vdnn-all          vDNN: offload every forward op's inputs       swap_baselines
    vdnn-conv         vDNN: offload convolution inputs              swap_baselines
    vdnn-dyn          vDNN's profiled choice among none/conv/all    swap_baselines
    superneurons      conv outputs, LRU cache, one conv ahead       swap_baselines
    autoswap-doa      AutoSwap, greedy by Duration of Absence       autoswap
    autoswap-aoa      ... by Area of Absence                        autoswap
    autoswap-wdoa     ... by Weighted DOA                           autoswap
    autoswap-swdoa    ... by Smoothed WDOA (rescored per pick)      autoswap
    autoswap-bo       AutoSwap's weighted score, weights by BO      autoswap_bo
    tidalpool         engine-aware covering, judged against all     tidalpool_swap
                      of the above in simulation

All are pure: the same iteration, limit and bandwidths give the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tidalplan.autoswap import autoswap
from tidalplan.autoswap_bo import autoswap_bo
from tidalplan.baselines import BASELINES
from tidalplan.gap_cover import tidalpool
from tidalplan.model import Iteration, SwapPlan

Policy = Callable[[Iteration, int, float, float], SwapPlan]


def _autoswap(score: str) -> Policy:
    def policy(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
        return autoswap(it, limit, out_gbps, in_gbps, score=score)  # type: ignore[arg-type]

    return policy


BASELINE_POLICIES: dict[str, Policy] = {
    **BASELINES,
    "autoswap-doa": _autoswap("doa"),
    "autoswap-aoa": _autoswap("aoa"),
    "autoswap-wdoa": _autoswap("wdoa"),
    "autoswap-swdoa": _autoswap("swdoa"),
    "autoswap-bo": autoswap_bo,
}
"""The published policies, which `tidalpool` must match or beat."""

POLICIES: tuple[str, ...] = (*BASELINE_POLICIES, "tidalpool")


def plans(
    it: Iteration, names: Iterable[str], limit: int, out_gbps: float, in_gbps: float
) -> dict[str, SwapPlan]:
    """The plan of each named policy. `tidalpool` is seeded with every baseline's plan, made
    once and shared with the baselines asked for. ValueError names an unknown policy."""
    names = list(names)
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"unknown swap policy {name!r}; one of {', '.join(POLICIES)}")
    wanted = BASELINE_POLICIES if "tidalpool" in names else {n: BASELINE_POLICIES[n] for n in names}
    made = {n: make(it, limit, out_gbps, in_gbps) for n, make in wanted.items()}
    if "tidalpool" in names:
        made["tidalpool"] = tidalpool(it, limit, out_gbps, in_gbps, seeds=made.values())
    return {n: made[n] for n in names}


def plan(it: Iteration, policy: str, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    """The swap plan `policy` makes for `it` under `limit` device bytes; ValueError names an
    unknown policy and lists the known ones."""
    return plans(it, [policy], limit, out_gbps, in_gbps)[policy]
