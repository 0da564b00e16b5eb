"""`tidalpool simulate TRACE`: swap policies under a memory limit, side by side.

The trace's steady iteration is extracted and every chosen policy plans its
swaps for the limit; `simulate` runs each plan and the table (or `--json`)
gives, per policy: feasible, overhead (a fraction of the unconstrained
iteration time), the simulated device peak, bytes moved each way, the stall,
and the footprint of the combined plan (the swapped iteration placed by
Planner I). Every feasible plan passes `validate_swaps` before it is shown.
`--fit` makes each policy's footprint fit the limit: where the placement
needs more, the schedule is made again for a lower limit (`combined.fit`),
and the row shows that schedule and the limit it was made for.

`--sweep` walks limits from the peak down (steps of `--step` of the peak) past
AutoSwap's `load_min` to the op-wise bound, printing overhead against memory
per policy (AutoSwap's Figs. 9 and 11); `--plot` draws that curve and the
memory curves at `--limit` (Fig. 8). Progress goes to stderr during a sweep.
Exit status: 0 done, 1 a plan that fails validation (a bug), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidalcore.units import format_size, parse_size
from tidalplan.model import Iteration, SwapPlan
from tidalplan.simulate import Result

DEFAULT_STEP = 0.05


class InputError(Exception):
    """The trace or an option cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    plan: SwapPlan
    result: Result
    footprint: int | None  # the combined plan's bytes; None when infeasible or not asked
    planned_for: int | None = None  # --fit: the limit the schedule was made for
    fits: bool | None = None  # --fit: a schedule's placement fits the limit (None: not asked)

    def as_json(self) -> dict[str, Any]:
        r = self.result
        return {
            "name": self.name,
            "feasible": r.feasible,
            "overhead": r.overhead,
            "iteration_ns": r.iteration_ns,
            "peak_bytes": r.peak_bytes,
            "out_bytes": r.out_bytes,
            "in_bytes": r.in_bytes,
            "stall_ns": r.stall_ns,
            "swaps": len(self.plan.swaps),
            "footprint_bytes": self.footprint,
            "planned_for_bytes": self.planned_for,
            "fits": self.fits,
        }


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `simulate` on an argparse subparsers object; the handler is `run`."""
    from tidalplan.policies import POLICIES

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="compare swap policies on a trace under a memory limit",
        description="Simulate one steady iteration of TRACE (a trace CSV v1) under a device"
        " memory limit with each swap policy, and compare.",
    )
    parser.add_argument("trace", type=Path, metavar="TRACE", help="trace CSV v1")
    parser.add_argument(
        "--limit",
        default="1.0",
        metavar="BYTES|FRACTION",
        help="device memory limit: bytes ('6GiB') or a fraction of the unconstrained peak"
        " (0.6 = 60%%; numbers up to 1 are fractions); default 1.0",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=12.0,
        metavar="GB/s",
        help="copy bandwidth of each direction, GB/s (default 12, PCIe 3)",
    )
    parser.add_argument(
        "--in-bandwidth",
        type=float,
        default=None,
        metavar="GB/s",
        help="host-to-device bandwidth when it differs from --bandwidth",
    )
    parser.add_argument(
        "--policy",
        default="all",
        metavar="NAME|all",
        help=f"one of {', '.join(POLICIES)}, a comma-separated list, or all (default)",
    )
    parser.add_argument(
        "--compute-scale", type=float, default=1.0, help="multiply op times (default 1)"
    )
    parser.add_argument("--sweep", action="store_true", help="walk limits from the peak down")
    parser.add_argument(
        "--step",
        type=float,
        default=DEFAULT_STEP,
        metavar="FRACTION",
        help=f"sweep step as a fraction of the peak (default {DEFAULT_STEP})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=Path, metavar="PICTURE.png", help="draw the curves")
    parser.add_argument(
        "--no-footprint", action="store_true", help="skip placing the combined plans"
    )
    parser.add_argument(
        "--place-time",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds Planner I may spend placing each combined plan (default 1; 0: its first"
        " greedy run only, which gives the same footprint on any machine)",
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help="plan for a lower limit where the placement would need more than --limit",
    )
    parser.set_defaults(handler=run)
    return parser


def load(path: Path) -> Iteration:
    """The steady iteration of the trace at `path` (InputError naming the file if unusable)."""
    from tidalplan import learn

    from tidaloffline import formats as tracecsv

    if not path.is_file():
        raise InputError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    try:
        kind = tracecsv.detect_format(path)
        if kind != "trace":
            raise InputError(f"{path}: a {kind} file; simulate needs a trace CSV v1 (with ops)")
        events = tracecsv.read_trace_csv(path)
        it = learn.extract(events, events.marks())
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:
        text = str(e)
        raise InputError(text if str(path) in text else f"{path}: {text}") from None
    if not it.ops:
        raise InputError(f"{path}: the iteration has no ops: nothing to time")
    return it


def parse_limit(text: str, peak: int) -> int:
    """Bytes from '0.6' (a fraction of `peak`) or '6GiB' / '6442450944' (bytes)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and value <= 1.0:
        if not value > 0:
            raise InputError(f"--limit {text}: a fraction must be above 0")
        return int(value * peak)
    try:
        limit = int(parse_size(text))
    except ValueError as e:
        raise InputError(f"--limit {text}: {e}") from None
    if limit <= 0:
        raise InputError(f"--limit {text}: must be positive")
    return limit


def policies(text: str) -> list[str]:
    from tidalplan.policies import POLICIES

    if text == "all":
        return list(POLICIES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in POLICIES:
            raise InputError(f"--policy: unknown policy {n!r}; one of {', '.join(POLICIES)}, all")
    if not names:
        raise InputError("--policy: no policy named")
    return names


def evaluate(
    it: Iteration,
    names: list[str],
    limit: int,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float,
    footprint: bool,
    fit_limit: bool = False,
    place_s: float = 1.0,
) -> list[Row]:
    """Plan, simulate and validate every policy at one limit (and place the feasible ones;
    with `fit_limit`, plan again for a lower limit where the placement does not fit)."""
    from tidalplan.combined import combine, fit
    from tidalplan.policies import plans
    from tidalplan.simulate import simulate
    from tidalplan.validate import validate_swaps

    rows = []
    for name, plan in plans(it, names, limit, out_gbps, in_gbps).items():
        r = simulate(it, plan, limit, out_gbps, in_gbps, compute_scale)
        fp = None
        if r.feasible:
            validate_swaps(it, plan, r, limit, in_gbps)
            if footprint or fit_limit:
                fp = int(combine(it, plan, r, time_limit_s=place_s).footprint)
        row = Row(name, plan, r, fp)
        if fit_limit and fp is not None:
            row = Row(name, plan, r, fp, limit, fp <= limit)
            if fp > limit:
                f = fit(
                    it,
                    name,
                    limit,
                    out_gbps,
                    in_gbps,
                    compute_scale,
                    time_limit_s=place_s,
                    known=(limit, fp),
                )
                if f is not None:
                    fp = int(f.combined.footprint)
                    row = Row(name, f.plan, f.result, fp, int(f.planned_for), True)
        rows.append(row)
    return rows


def sweep_limits(peak: int, floor: int, step: float) -> list[int]:
    """Limits from `peak` down by `step` × peak while they stay at or above `floor`."""
    out: list[int] = []
    k = 0
    while True:
        limit = int(peak * (1.0 - k * step))
        if limit < floor or limit <= 0:
            return out
        out.append(limit)
        k += 1


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from tidalplan.autoswap import load as load_curve
    from tidalplan.autoswap import load_min, op_bound
    from tidalplan.simulate import no_limit
    from tidalplan.validate import InvalidSwapPlan

    out_gbps = args.bandwidth
    in_gbps = args.in_bandwidth if args.in_bandwidth is not None else out_gbps
    try:
        if not (0 < out_gbps < float("inf") and 0 < in_gbps < float("inf")):
            raise InputError("--bandwidth and --in-bandwidth must be positive GB/s")
        if not 0 < args.compute_scale < float("inf"):
            raise InputError("--compute-scale must be positive")
        if not 0 < args.step < 1:
            raise InputError("--step must lie in (0, 1)")
        if args.fit and args.no_footprint:
            raise InputError("--fit places the plans: it cannot go with --no-footprint")
        if not 0 <= args.place_time < float("inf"):
            raise InputError("--place-time must be a number of seconds >= 0")
        if args.fit and args.sweep:
            raise InputError("--fit works at one --limit, not in a --sweep")
        names = policies(args.policy)
        it = load(args.trace)
        peak = int(load_curve(it).max(initial=0))
        limit = parse_limit(args.limit, peak)
    except InputError as e:
        print(f"tidalpool simulate: {e}", file=sys.stderr)
        return 2
    base = no_limit(it, args.compute_scale)
    lmin, bound = load_min(it), op_bound(it)
    head: dict[str, Any] = {
        "trace": str(args.trace),
        "bandwidth_gbps": out_gbps,
        "in_bandwidth_gbps": in_gbps,
        "compute_scale": args.compute_scale,
        "baseline_ns": base.baseline_ns,
        "unconstrained_peak_bytes": peak,
        "load_min_bytes": lmin,
        "op_bound_bytes": bound,
    }
    console = Console(width=max(Console().width, 132))  # the table's columns side by side
    try:
        if args.sweep:
            grid = sweep_limits(peak, bound, args.step)
            sweep: list[tuple[int, list[Row]]] = []
            started = time.monotonic()
            for k, lim in enumerate(grid):
                print(
                    f"[{time.monotonic() - started:6.1f} s] limit {lim / peak:.2f} of the peak"
                    f" ({k + 1}/{len(grid)})",
                    file=sys.stderr,
                    flush=True,
                )
                rows = evaluate(it, names, lim, out_gbps, in_gbps, args.compute_scale, False)
                sweep.append((lim, rows))
            if args.json:
                head["sweep"] = [
                    {
                        "limit_bytes": lim,
                        "fraction": lim / peak,
                        "policies": [r.as_json() for r in rows],
                    }
                    for lim, rows in sweep
                ]
                print(json.dumps(head))
            else:
                _sweep_table(console, Table, head, names, sweep, peak)
            if args.plot:
                at = evaluate(it, names, limit, out_gbps, in_gbps, args.compute_scale, False)
                _draw(args.plot, str(args.trace), peak, names, sweep, at, limit, base)
            return 0
        rows = evaluate(
            it,
            names,
            limit,
            out_gbps,
            in_gbps,
            args.compute_scale,
            not args.no_footprint,
            args.fit,
            args.place_time,
        )
    except InvalidSwapPlan as e:
        print(f"tidalpool simulate: a plan failed validation (a bug): {e}", file=sys.stderr)
        return 1
    if args.json:
        head["limit_bytes"] = limit
        head["policies"] = [r.as_json() for r in rows]
        print(json.dumps(head))
    else:
        console.print(
            f"{args.trace}: iteration {base.baseline_ns / 1e6:.2f} ms, peak {format_size(peak)},"
            f" load_min {format_size(lmin)} ({lmin / peak:.0%}), op-wise bound"
            f" {format_size(bound)} ({bound / peak:.0%}); limit {format_size(limit)}"
            f" ({limit / peak:.0%}), {out_gbps:g}/{in_gbps:g} GB/s"
        )
        table = Table()
        columns = ["policy", "feasible", "overhead", "peak", "out", "in", "stall", "footprint"]
        for col in columns + (["planned for"] if args.fit else []):
            table.add_column(col, justify="left" if col == "policy" else "right")
        for row in rows:
            r = row.result
            table.add_row(
                row.name,
                "yes" if r.feasible else "no",
                _percent(r.overhead) if r.feasible else "—",
                format_size(r.peak_bytes),
                format_size(r.out_bytes),
                format_size(r.in_bytes),
                f"{r.stall_ns / 1e6:.2f} ms",
                format_size(row.footprint) if row.footprint is not None else "—",
                *([_planned_for(row)] if args.fit else []),
            )
        console.print(table)
    if args.plot:
        _draw(args.plot, str(args.trace), peak, names, [], rows, limit, base)
    return 0


def _planned_for(row: Row) -> str:
    if row.fits is None or row.planned_for is None:
        return "—"
    return format_size(row.planned_for) if row.fits else "does not fit"


def _sweep_table(
    console: Any,
    table_type: Any,
    head: dict[str, Any],
    names: list[str],
    sweep: list[tuple[int, list[Row]]],
    peak: int,
) -> None:
    console.print(
        f"{head['trace']}: overhead by limit; peak {format_size(peak)}, load_min"
        f" {head['load_min_bytes'] / peak:.0%}, op-wise bound {head['op_bound_bytes'] / peak:.0%}"
        f" of it; — infeasible"
    )
    table = table_type()
    table.add_column("limit", justify="right")
    for n in names:
        table.add_column(n, justify="right")
    for lim, rows in sweep:
        table.add_row(
            f"{lim / peak:.0%}",
            *(_percent(r.result.overhead) if r.result.feasible else "—" for r in rows),
        )
    console.print(table)


def _draw(
    path: Path,
    title: str,
    peak: int,
    names: list[str],
    sweep: list[tuple[int, list[Row]]],
    at: list[Row],
    limit: int,
    base: Result,
) -> None:
    from tidaloffline.plot import plot_swaps

    curves = {
        n: [
            (lim / peak, r.result.overhead)
            for lim, rows in sweep
            for r in rows
            if r.name == n and r.result.feasible
        ]
        for n in names
    }
    memory = {r.name: r.result.curve for r in at if r.result.feasible}
    plot_swaps(path, title, curves, memory, base.curve, limit)
