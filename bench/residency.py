"""The daemon's swaps-only plan with contiguous placement against virtual residency (pages).

For every model trace in ../shared/traces/models, each limit (a fraction of the unconstrained
peak) and each copy bandwidth, plans the steady iteration as the daemon does (tidalpool's search
with swaps alone, swap-ins issued at op starts):

- contiguous: `combined.fit`: the schedule's pieces placed in one range, made again for lower
  limits while the placement is taller than the limit (the daemon's plan before virtual
  residency);
- paged: `paged.plan`: every block at one virtual address for life, the limit counting mapped
  pages of `--page` bytes; one schedule, no refitting;

and, with `--baselines paged`, every swap-only baseline (vDNN's three policies, AutoSwap's five)
given virtual residency too (its schedule made on the same paged iterations, the fastest kept),
its swap-ins issued at op starts as a session runs them (`wire.on_ops`, as the daemon's are);
with `--baselines both`, at its best: the faster of that and its contiguous `fit` (hours for
all the traces on two cores). Each step is reported over the
swap-only lower bound of the same iteration and limit (`step_bound(recompute=False)`, in bytes:
no plan of either kind can beat it), with the seconds each plan took on this machine.

    .venv/bin/python bench/residency.py [--fractions 0.9,0.7,0.5,0.3] [--gbps 12]
        [--baselines paged|both] [--traces NAME ...] [--dir DIR] [--page 2MiB] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidalcore.units import parse_size
from tidaloffline.simulate_command import load
from tidalplan import combined, paged, policies, wire
from tidalplan.bound import step_bound
from tidalplan.learn import live_bytes
from tidalplan.model import Iteration, SwapPlan

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces" / "models"
SWAP_ONLY = (
    "vdnn-all",
    "vdnn-conv",
    "vdnn-dyn",
    *(f"autoswap-{s}" for s in ("doa", "aoa", "wdoa", "swdoa", "bo")),
)

Policy = Callable[[Iteration, int, float, float], SwapPlan]


def daemon_policy(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    """What the daemon plans a session with: swaps alone, swap-ins issued at op starts."""
    return wire.on_ops(it, policies.swaps_only(it, limit, out_gbps, in_gbps))


def as_run(policy: Policy) -> Policy:
    """`policy` with its swap-ins issued at op starts, as a session issues them (`wire.on_ops`):
    the plan a session would run."""
    return lambda it, limit, o, i: wire.on_ops(it, policy(it, limit, o, i))


def timed(make: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    made = make()
    return made, round(time.perf_counter() - started, 2)


def contiguous(it: Iteration, policy: Policy, limit: int, gbps: float) -> dict[str, Any]:
    made, seconds = timed(lambda: combined.fit(it, policy, limit, gbps, gbps))
    return {
        "fits": made.fits,
        "step_ns": made.result.iteration_ns if made.fits else None,
        "footprint": made.footprint,
        "planned_for": int(made.planned_for),
        "rounds": made.rounds,
        "seconds": seconds,
    }


def in_pages(it: Iteration, policy: Policy, limit: int, gbps: float, page: int) -> dict[str, Any]:
    made, seconds = timed(lambda: paged.plan(it, policy, limit, gbps, gbps, page=page))
    return {
        "fits": made.fits,
        "step_ns": made.result.iteration_ns if made.fits else None,
        "mapped_peak": made.mapped_peak,
        "out_bytes": int(made.result.out_bytes) if made.fits else None,
        "seconds": seconds,
    }


def ratio(step: int | None, bound: int | None) -> float | None:
    return None if step is None or not bound else round(step / bound, 4)


def case(
    it: Iteration, name: str, fraction: float, gbps: float, page: int, baselines: str | None
) -> dict[str, Any]:
    peak = int(live_bytes(it).max()) + sum(size for _, size in it.persistent)
    limit = int(peak * fraction)
    bound = step_bound(it, limit, gbps, gbps, recompute=False).ns
    row: dict[str, Any] = {
        "trace": name,
        "ticks": it.ticks,
        "fraction": fraction,
        "limit": limit,
        "gbps": gbps,
        "baseline_ns": sum(op.duration_ns for op in it.ops),
        "bound_ns": bound,
        "contiguous": contiguous(it, daemon_policy, limit, gbps),
        "paged": in_pages(it, daemon_policy, limit, gbps, page),
    }
    for kind in ("contiguous", "paged"):
        row[kind]["ratio"] = ratio(row[kind]["step_ns"], bound)
    if baselines:
        best: tuple[int, str] | None = None
        for b in SWAP_ONLY:
            run = as_run(policies.policy(b))
            made = [in_pages(it, run, limit, gbps, page)]
            if baselines == "both":
                made.append(contiguous(it, run, limit, gbps))
            steps = [m["step_ns"] for m in made if m["step_ns"] is not None]
            row.setdefault("baselines", {})[b] = min(steps) if steps else None
            if steps and (best is None or min(steps) < best[0]):
                best = (min(steps), b)
        row["best_baseline"] = None if best is None else {"name": best[1], "step_ns": best[0]}
    return row


def report(rows: list[dict[str, Any]]) -> None:
    def ms(ns: int | None) -> str:
        return "—" if ns is None else f"{ns / 1e6:.2f}"

    def r(x: float | None) -> str:
        return "—" if x is None else f"{x:.3f}"

    print(
        "| trace | limit | GB/s | bound ms | contiguous ms (×bound, rounds, s) | paged ms"
        " (×bound, s) | best swap-only baseline ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        c, p = row["contiguous"], row["paged"]
        best = row.get("best_baseline")
        print(
            f"| {row['trace']} | {row['fraction']:g} | {row['gbps']:g} | {ms(row['bound_ns'])} |"
            f" {ms(c['step_ns'])} ({r(c['ratio'])}, {c['rounds']}, {c['seconds']}) |"
            f" {ms(p['step_ns'])} ({r(p['ratio'])}, {p['seconds']}) |"
            + (f" {ms(best['step_ns'])} ({best['name']}) |" if best else " — |")
        )
    ratios = [row["paged"]["ratio"] for row in rows if row["paged"]["ratio"] is not None]
    if ratios:
        print(
            f"paged over the bound: median {statistics.median(ratios):.3f},"
            f" worst {max(ratios):.3f} ({len(ratios)} feasible of {len(rows)})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="0.9,0.7,0.5,0.3")
    parser.add_argument("--gbps", default="12", help="copy bandwidths, comma-separated")
    parser.add_argument("--page", default="2MiB")
    parser.add_argument("--baselines", choices=("paged", "both"), default=None)
    parser.add_argument("--traces", nargs="*", default=None)
    parser.add_argument("--dir", type=Path, default=TRACES, help="where the traces are")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not args.dir.is_dir():
        print(
            f"residency.py: {args.dir} is missing (the model traces of ../shared)", file=sys.stderr
        )
        return 2
    paths = sorted(args.dir.glob("*.trace.csv"))
    if args.traces:
        paths = [p for p in paths if any(p.name.startswith(t) for t in args.traces)]
    page = parse_size(args.page)
    rows = []
    for path in paths:
        it = load(path)
        for gbps in (float(g) for g in args.gbps.split(",")):
            for fraction in (float(f) for f in args.fractions.split(",")):
                row = case(it, path.name.split(".")[0], fraction, gbps, page, args.baselines)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    report(rows)
    if args.json:
        args.json.write_text(json.dumps({"page": page, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
