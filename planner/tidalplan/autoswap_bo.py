"""AutoSwap's Bayesian optimization of the priority score (SmartPool/AutoSwap, Section IV-C).

IV-C: "we generate the aggregated PS via a linear combination of the 4 basic scores
... The 4 priority scores are standardized before feeding into the formula. We use
Bayesian Optimization to automatically tunes the weights a, b, c, and d, whose values
range between [-1,1]." So the combined score is a·AOA + b·DOA + c·WDOA + d·SWDOA
(`autoswap.scores`, Eq. 3). Each trial plans with its weights (`autoswap.autoswap`,
whose candidates hold the persistent blocks' gaps, the ones across the iteration
boundary included: VI-B3's "Our PS and BO successfully capture them") and is
scored by `simulate`'s overhead; an infeasible plan scores `INFEASIBLE` plus how
far its simulated peak is above the limit, so the search still has a slope to
follow. The paper's four scores alone are the first four trials (weights
(0, 0, 0, 1) and so on), so the result is never worse than the best of them.

The sampler is Optuna's TPE, seeded: the same iteration, limit and bandwidths
give the same weights. The paper uses a Gaussian-process prior; Optuna's
GPSampler needs PyTorch, which the daemon does not depend on.
"""

from __future__ import annotations

from dataclasses import dataclass

import optuna

from tidalplan.autoswap import autoswap
from tidalplan.model import Iteration, SwapPlan
from tidalplan.simulate import Result, simulate

TRIALS = 40
INFEASIBLE = 1e6

Weights = tuple[float, float, float, float]

# The pure scores as weights of (AOA, DOA, WDOA, SWDOA): tried first.
_PURE: tuple[Weights, ...] = ((1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1))


@dataclass(frozen=True, slots=True)
class Tuned:
    weights: Weights
    plan: SwapPlan
    result: Result
    trials: int


def cost(r: Result, limit: int) -> float:
    """What a trial minimizes: the overhead, or a large constant plus the relative excess."""
    if r.feasible:
        return r.overhead
    return INFEASIBLE * (1 + max(0, r.peak_bytes - limit) / max(limit, 1))


def tune(
    it: Iteration,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    trials: int = TRIALS,
    seed: int = 0,
) -> Tuned:
    """The weights of the best of `trials` trials, with their plan and simulated result."""
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    # Ask and tell: `Study.optimize` would log every trial and change nothing else. The
    # study's creation logs one line through Optuna's logger, which the process's edge (the
    # daemon, the command line) configures; the planner leaves logging alone.
    sampler = optuna.samplers.TPESampler(seed=seed)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    for pure in _PURE[:trials]:
        study.enqueue_trial(dict(zip("abcd", pure, strict=True)))
    best: Tuned | None = None
    best_cost = float("inf")
    for _ in range(trials):
        trial = study.ask()
        w: Weights = (
            trial.suggest_float("a", -1.0, 1.0),
            trial.suggest_float("b", -1.0, 1.0),
            trial.suggest_float("c", -1.0, 1.0),
            trial.suggest_float("d", -1.0, 1.0),
        )
        plan = autoswap(it, limit, out_gbps, in_gbps, score="combined", weights=w)
        r = simulate(it, plan, limit, out_gbps, in_gbps)
        c = cost(r, limit)
        if c < best_cost:
            best, best_cost = Tuned(w, plan, r, trials), c
        study.tell(trial, c)
    assert best is not None
    return best


def autoswap_bo(
    it: Iteration, limit: int, out_gbps: float, in_gbps: float, trials: int = TRIALS
) -> SwapPlan:
    """The `autoswap-bo` policy: AutoSwap with the tuned combined score."""
    return tune(it, limit, out_gbps, in_gbps, trials).plan
