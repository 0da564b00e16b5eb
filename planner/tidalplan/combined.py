"""The plan of a named policy: `placed` with the policy found by its name.

Everything of a plan (its pieces, their placement, refitting for lower limits) is
`tidalplan.placed`, which the daemon imports without the published policies; this module
adds only the names of `policies.POLICIES`, for the offline tools and the benchmarks.
"""

from __future__ import annotations

from tidalcore.units import ALIGNMENT

from tidalplan.model import Iteration
from tidalplan.placed import (
    BLOCK,
    PERSISTENT,
    SCRATCH,
    Combined,
    Plan,
    Policy,
    Split,
    combine,
    pieces,
    split,
    unlimited,
)
from tidalplan.placed import fit as fit_policy
from tidalplan.policies import plan as make_plan

__all__ = [
    "BLOCK",
    "PERSISTENT",
    "SCRATCH",
    "Combined",
    "Plan",
    "Policy",
    "Split",
    "combine",
    "fit",
    "pieces",
    "split",
    "unlimited",
]


def fit(
    it: Iteration,
    policy: str | Policy,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
    rounds: int = 8,
    alignment: int = ALIGNMENT,
    time_limit_s: float = 2.0,
    budget_s: float | None = None,
) -> Plan:
    """`placed.fit` of `policy`: a name in `policies.POLICIES`, or a policy."""
    make: Policy = (
        (lambda it, lim, o, i: make_plan(it, policy, lim, o, i))
        if isinstance(policy, str)
        else policy
    )
    return fit_policy(
        it,
        make,
        limit,
        out_gbps,
        in_gbps,
        compute_scale,
        rounds,
        alignment,
        time_limit_s,
        budget_s,
    )
