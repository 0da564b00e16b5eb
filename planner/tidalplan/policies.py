"""Every memory policy by name, one signature: `plan(it, policy, limit, out_gbps, in_gbps)`.

    policy            what it is                                          module
    vdnn-all          vDNN: offload every forward layer's input X          baselines
    vdnn-conv         vDNN: offload convolution inputs                     baselines
    vdnn-dyn          vDNN's profiling passes: the first that fits         baselines
    superneurons      cost-aware recomputation of cheap layers, and the   superneurons
                      LRU tensor cache for convolution outputs
    autoswap-doa      AutoSwap, greedy by Duration of Absence              autoswap
    autoswap-aoa      ... by Area of Absence                               autoswap
    autoswap-wdoa     ... by Weighted DOA                                  autoswap
    autoswap-swdoa    ... by Smoothed WDOA (rescored per pick)             autoswap
    autoswap-bo       AutoSwap's weighted score, weights by BO             autoswap_bo
    capuchin          Capuchin: swap or recompute per tensor by free      capuchin
                      time and memory saved per second of recompute
    checkmate         recomputation only, by an integer program           checkmate
    tidalpool         its own search: keep, swap or recompute each gap,   search
                      for the shortest simulated step

A plan holds swaps and recomputations. All are pure: the same iteration, limit and
bandwidths give the same plan; none is made from another's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tidalplan.autoswap import autoswap
from tidalplan.autoswap_bo import autoswap_bo
from tidalplan.baselines import BASELINES
from tidalplan.capuchin import capuchin
from tidalplan.checkmate import checkmate
from tidalplan.model import Iteration, SwapPlan
from tidalplan.search import search
from tidalplan.superneurons import superneurons

Policy = Callable[[Iteration, int, float, float], SwapPlan]


def _autoswap(score: str) -> Policy:
    def policy(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
        return autoswap(it, limit, out_gbps, in_gbps, score=score)  # type: ignore[arg-type]

    return policy


BASELINE_POLICIES: dict[str, Policy] = {
    **BASELINES,
    "superneurons": superneurons,
    "autoswap-doa": _autoswap("doa"),
    "autoswap-aoa": _autoswap("aoa"),
    "autoswap-wdoa": _autoswap("wdoa"),
    "autoswap-swdoa": _autoswap("swdoa"),
    "autoswap-bo": autoswap_bo,
    "capuchin": capuchin,
    "checkmate": checkmate,
}
"""The published policies, which `tidalpool` must match or beat."""

POLICIES: tuple[str, ...] = (*BASELINE_POLICIES, "tidalpool")


def swaps_only(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    """tidalpool's search with swaps alone: the plan for an executor that moves blocks but
    cannot rebuild them (a session's swapping executor, PyTorch's saved tensors)."""
    return search(it, limit, out_gbps, in_gbps, recompute=False)


def policy(name: str) -> Policy:
    """The policy called `name`; ValueError names an unknown one and lists the known ones."""
    if name == "tidalpool":
        return search
    if name not in BASELINE_POLICIES:
        raise ValueError(f"unknown memory policy {name!r}; one of {', '.join(POLICIES)}")
    return BASELINE_POLICIES[name]


def plans(
    it: Iteration, names: Iterable[str], limit: int, out_gbps: float, in_gbps: float
) -> dict[str, SwapPlan]:
    """The plan of each named policy, each made on its own. ValueError names an unknown
    policy."""
    makers = {name: policy(name) for name in names}
    return {name: make(it, limit, out_gbps, in_gbps) for name, make in makers.items()}


def plan(it: Iteration, name: str, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    """The plan `name` makes for `it` under `limit` device bytes; ValueError names an unknown
    policy and lists the known ones."""
    return policy(name)(it, limit, out_gbps, in_gbps)
