"""What bucketing inputs of many sizes costs: `tidalpool simulate TRACE --buckets`.

A job whose inputs come in many sizes (sequence lengths, batch sizes) pads each to one of a few
bucket sizes, so that it runs few iteration shapes. Each shape is a plan the daemon makes and
caches (at most `max_plan_shapes`), and whose first iterations run unplanned while it learns;
padding costs compute, and under a limit, swaps. Given a trace of shapes that are sizes of one
input (`tidalpool.torch.record(..., batches=)` at each), ordered by their unconstrained peak,
every choice of buckets that holds the largest shape is costed: each shape runs as the smallest
bucket at least its size, under the daemon's plan of that bucket at the limit (`simulate`'s
daemon row; paged with --page), and the step is averaged over the shapes as often as the trace
runs each. Which shapes may be padded to which is the caller's knowledge: the order by peak is
the order of sizes only when the shapes differ in one input's size.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import combinations
from typing import TYPE_CHECKING, Any

from tidalcore.units import format_size

if TYPE_CHECKING:
    from tidalplan.model import Iteration

MAX_SHAPES = 12
"""Shapes whose choices of buckets are all costed (2^(n-1) choices)."""


def advise(
    its: dict[str, Iteration],
    counts: dict[str, int],
    step_of: Callable[[str, Iteration], int | None],
) -> dict[str, Any]:
    """Every choice of buckets (each holding the largest shape) with its plans and mean step,
    as a JSON value: the shapes by size, each bucket's own step (`step_of`: under the daemon's
    plan at the limit; None where it has none), the choices from the fewest plans up and,
    within as many plans, the fastest first."""
    from tidalplan.autoswap import load as load_curve

    if len(its) > MAX_SHAPES:
        raise ValueError(f"{len(its)} shapes: at most {MAX_SHAPES} are compared as buckets")
    peak = {s: int(load_curve(it).max(initial=0)) for s, it in its.items()}
    order = sorted(its, key=lambda s: (peak[s], list(its).index(s)))
    step = {s: step_of(s, its[s]) for s in order}
    weight = [counts.get(s, 0) for s in order]
    if not sum(weight):
        weight = [1] * len(order)
    total = sum(weight)
    largest = order[-1]
    choices: list[dict[str, Any]] = []
    for n in range(len(order)):
        for smaller in combinations(order[:-1], n):
            buckets = [*smaller, largest]
            runs_as = [next(b for b in buckets if order.index(b) >= k) for k in range(len(order))]
            steps = [step[b] for b in runs_as]
            mean: float | None = None
            if all(x is not None for x in steps):
                mean = sum(w * (x or 0) for w, x in zip(weight, steps, strict=True)) / total
            choices.append(
                {
                    "buckets": buckets,
                    "plans": len(buckets),
                    "padded": [s for s, b in zip(order, runs_as, strict=True) if b != s],
                    "feasible": mean is not None,
                    "mean_step_ns": mean,
                }
            )
    best = choices[-1]["mean_step_ns"]  # every shape a bucket: its own plan
    for c in choices:
        mean = c["mean_step_ns"]
        c["over_every_shape_its_own"] = mean / best if mean is not None and best else None
    choices.sort(key=lambda c: (c["plans"], c["mean_step_ns"] is None, c["mean_step_ns"] or 0))
    shapes = {
        s: {"peak_bytes": peak[s], "iterations": counts.get(s, 0), "step_ns": step[s]}
        for s in order
    }
    return {"shapes": shapes, "choices": choices}


def render_advice(advice: dict[str, Any], limit: int | None, console: Any) -> None:
    """The shapes' own steps, then the fastest choice of buckets for each number of plans."""
    from tidalclient.tables import Fitted

    def ms(ns: float | None) -> str:
        return "—" if ns is None else f"{ns / 1e6:.2f} ms"

    shapes = advice["shapes"]
    console.print(
        Fitted(
            ("shape", "peak", "iterations", "step" if limit is None else "step, daemon's plan"),
            [
                (s, format_size(v["peak_bytes"]), str(v["iterations"]), ms(v["step_ns"]))
                for s, v in shapes.items()
            ],
            title="shapes, smallest first"
            + ("" if limit is None else f" (limit {format_size(limit)})"),
            left=(0,),
        )
    )
    fastest: dict[int, dict[str, Any]] = {}
    for c in advice["choices"]:
        fastest.setdefault(c["plans"], c)
    console.print(
        Fitted(
            ("plans", "buckets", "padded", "mean step", "× every shape its own"),
            [
                (
                    str(n),
                    ", ".join(c["buckets"]),
                    ", ".join(c["padded"]) or "—",
                    ms(c["mean_step_ns"]),
                    "—"
                    if c["over_every_shape_its_own"] is None
                    else f"{c['over_every_shape_its_own']:.3f}",
                )
                for n, c in sorted(fastest.items())
            ],
            title="the fastest buckets for each number of plans",
            left=(1, 2),
        )
    )
    console.print(
        "Each shape runs as the smallest bucket at least its size (by peak), under that"
        " bucket's plan; the mean step weighs the shapes as often as the trace runs each."
        + ("" if limit is None else " —: a bucket the daemon has no plan for at this limit."),
        highlight=False,
    )
