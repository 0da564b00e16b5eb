"""`tidalpool simulate TRACE`: memory policies under a limit, side by side, against a bound.

The trace's steady iteration is extracted and every chosen policy makes its plan
for the limit: swaps, recomputations, and the placement of what they leave on the
device (`combined.fit`: where the placement needs more than the limit, the
schedule is made again for a lower one). A plan counts as feasible only when its
schedule runs under the simulator, passes `validate_swaps`, and its placement
fits the limit. The table (or `--json`) gives, per policy: feasible, overhead
(a fraction of the unconstrained iteration time), the step's ratio to a lower
bound on the step under the limit (`bound.step_bound`), the simulated device
peak, the placed footprint, bytes copied each way, bytes recomputed and the
recomputation's time, and the stall. The `portfolio` row is the best feasible
plan of all the policies shown; `tidalpool`'s own row is its search alone.

`--sweep` walks limits from the peak down (steps of `--step` of the peak) past
AutoSwap's `load_min` to the op-wise bound, printing overhead against memory
per policy (AutoSwap's Figs. 9 and 11); `--plot` draws that curve and the
memory curves at `--limit` (Fig. 8). Progress goes to stderr.
Exit status: 0 done, 1 a plan that fails validation (a bug), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidalcore.units import format_size, parse_size
from tidalplan.model import Iteration

if TYPE_CHECKING:
    from tidalplan.combined import Plan
    from tidalplan.simulate import Result

DEFAULT_STEP = 0.05


class InputError(Exception):
    """The trace or an option cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    plan: Plan
    bound_ns: int | None  # the lower bound on the step under this limit; None: none fits
    of: str | None = None  # the portfolio row: whose plan it is

    @property
    def ratio(self) -> float | None:
        """The step over the bound, for a feasible plan."""
        if not self.plan.fits or not self.bound_ns:
            return None
        return self.plan.result.iteration_ns / self.bound_ns

    def as_json(self) -> dict[str, Any]:
        p = self.plan
        r = p.result
        return {
            "name": self.name,
            **({"of": self.of} if self.of is not None else {}),
            "feasible": p.fits,
            "schedule_feasible": r.feasible,
            "overhead": r.overhead,
            "iteration_ns": r.iteration_ns,
            "bound_ns": self.bound_ns,
            "ratio_to_bound": self.ratio,
            "peak_bytes": r.peak_bytes,
            "placed_bytes": p.footprint,
            "planned_for_bytes": p.planned_for,
            "out_bytes": r.out_bytes,
            "in_bytes": r.in_bytes,
            "recomputed_bytes": r.recomputed_bytes,
            "recompute_ns": r.recompute_ns,
            "stall_ns": r.stall_ns,
            "swaps": len(p.schedule.swaps),
            "recomputes": len(p.schedule.recomputes),
        }


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `simulate` on an argparse subparsers object; the handler is `run`."""
    from tidalplan.policies import POLICIES

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="compare memory policies on a trace under a memory limit",
        description="Make each memory policy's plan (swaps, recomputations, placement) for one"
        " steady iteration of TRACE (a trace CSV v1) under a device memory limit, simulate it,"
        " and compare, beside a lower bound on the step.",
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
        "--place-time",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds Planner I may spend placing each plan (default 0: its first greedy run"
        " only, which gives the same footprint on any machine)",
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
    place_s: float = 0.0,
    say: Callable[[str], None] | None = None,
) -> list[Row]:
    """Every policy's placed plan at one limit (`combined.fit`), each schedule validated, and
    the portfolio: the best feasible of them. `say` hears of each policy as it starts."""
    from tidalplan.bound import step_bound
    from tidalplan.combined import fit
    from tidalplan.policies import policy

    bound = step_bound(it, limit, out_gbps, in_gbps, compute_scale).ns
    rows = []
    for k, name in enumerate(names):
        if say is not None:
            say(f"{name} ({k + 1}/{len(names)})")
        made = fit(it, policy(name), limit, out_gbps, in_gbps, compute_scale, time_limit_s=place_s)
        rows.append(Row(name, made, bound))
    fitting = [r for r in rows if r.plan.fits]
    if len(rows) > 1 and fitting:
        best = min(fitting, key=lambda r: (r.plan.result.iteration_ns, r.plan.footprint or 0))
        rows.append(Row("portfolio", best.plan, bound, of=best.name))
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


def _say(started: float) -> Callable[[str], None]:
    """Progress lines on stderr, each with the seconds since `started`."""

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    return say


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from tidalplan.autoswap import load as load_curve
    from tidalplan.autoswap import load_min, op_bound
    from tidalplan.simulate import no_limit
    from tidalplan.validate import InvalidPlacement, InvalidSwapPlan

    out_gbps = args.bandwidth
    in_gbps = args.in_bandwidth if args.in_bandwidth is not None else out_gbps
    try:
        if not (0 < out_gbps < float("inf") and 0 < in_gbps < float("inf")):
            raise InputError("--bandwidth and --in-bandwidth must be positive GB/s")
        if not 0 < args.compute_scale < float("inf"):
            raise InputError("--compute-scale must be positive")
        if not 0 < args.step < 1:
            raise InputError("--step must lie in (0, 1)")
        if not 0 <= args.place_time < float("inf"):
            raise InputError("--place-time must be a number of seconds >= 0")
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
    started = time.monotonic()
    say = _say(started)
    try:
        if args.sweep:
            grid = sweep_limits(peak, bound, args.step)
            sweep: list[tuple[int, list[Row]]] = []
            for k, lim in enumerate(grid):
                where = f"limit {lim / peak:.2f} of the peak ({k + 1}/{len(grid)})"

                def said(text: str, where: str = where) -> None:
                    say(f"{where}: {text}")

                rows = evaluate(
                    it, names, lim, out_gbps, in_gbps, args.compute_scale, args.place_time, said
                )
                sweep.append((lim, rows))
            if args.json:
                head["sweep"] = [
                    {
                        "limit_bytes": lim,
                        "fraction": lim / peak,
                        "bound_ns": rows[0].bound_ns if rows else None,
                        "policies": [r.as_json() for r in rows],
                    }
                    for lim, rows in sweep
                ]
                print(json.dumps(head))
            else:
                _sweep_table(console, head, names, sweep, peak)
            if args.plot:
                at = evaluate(
                    it, names, limit, out_gbps, in_gbps, args.compute_scale, args.place_time
                )
                _draw(args.plot, str(args.trace), peak, names, sweep, at, limit, base)
            return 0
        rows = evaluate(
            it, names, limit, out_gbps, in_gbps, args.compute_scale, args.place_time, say
        )
    except (InvalidSwapPlan, InvalidPlacement) as e:
        print(f"tidalpool simulate: a plan failed validation (a bug): {e}", file=sys.stderr)
        return 1
    step_bound = rows[0].bound_ns if rows else None
    if args.json:
        head["limit_bytes"] = limit
        head["bound_ns"] = step_bound
        head["policies"] = [r.as_json() for r in rows]
        print(json.dumps(head))
    else:
        console.print(
            f"{args.trace}: iteration {base.baseline_ns / 1e6:.2f} ms, peak {format_size(peak)},"
            f" load_min {format_size(lmin)} ({lmin / peak:.0%}), op-wise bound"
            f" {format_size(bound)} ({bound / peak:.0%}); limit {format_size(limit)}"
            f" ({limit / peak:.0%}), {out_gbps:g}/{in_gbps:g} GB/s; the step cannot be"
            + (
                f" under {step_bound / 1e6:.2f} ms at this limit"
                if step_bound is not None
                else " made to fit this limit by any plan"
            )
        )
        console.print(_table(rows))
    if args.plot:
        _draw(args.plot, str(args.trace), peak, names, [], rows, limit, base)
    return 0


def _table(rows: list[Row]) -> Any:
    from rich.table import Table

    table = Table()
    columns = [
        "policy",
        "feasible",
        "overhead",
        "× bound",
        "peak",
        "placed",
        "out",
        "in",
        "recomputed",
        "stall",
    ]
    for col in columns:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for row in rows:
        p = row.plan
        r = p.result
        if p.fits:
            feasible = (
                "yes" if p.planned_for == p.limit else f"yes, for {format_size(p.planned_for)}"
            )
        elif r.feasible:
            feasible = "no: placed over"
        else:
            feasible = "no"
        table.add_row(
            row.name if row.of is None else f"{row.name} ({row.of})",
            feasible,
            _percent(r.overhead) if p.fits else "—",
            f"{row.ratio:.3f}" if row.ratio is not None else "—",
            format_size(r.peak_bytes),
            format_size(p.footprint) if p.footprint is not None else "—",
            format_size(r.out_bytes),
            format_size(r.in_bytes),
            format_size(r.recomputed_bytes),
            f"{r.stall_ns / 1e6:.2f} ms",
        )
    return table


def _sweep_table(
    console: Any,
    head: dict[str, Any],
    names: list[str],
    sweep: list[tuple[int, list[Row]]],
    peak: int,
) -> None:
    from rich.table import Table

    console.print(
        f"{head['trace']}: overhead by limit (feasible placed plans); peak {format_size(peak)},"
        f" load_min {head['load_min_bytes'] / peak:.0%}, op-wise bound"
        f" {head['op_bound_bytes'] / peak:.0%} of it; — infeasible"
    )
    table = Table()
    table.add_column("limit", justify="right")
    table.add_column("bound", justify="right")
    for n in names:
        table.add_column(n, justify="right")
    for lim, rows in sweep:
        by_name = {r.name: r for r in rows}
        b = rows[0].bound_ns if rows else None
        base = head["baseline_ns"]
        table.add_row(
            f"{lim / peak:.0%}",
            _percent(b / base - 1) if b is not None and base else "—",
            *(
                _percent(by_name[n].plan.result.overhead) if by_name[n].plan.fits else "—"
                for n in names
            ),
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
            (lim / peak, r.plan.result.overhead)
            for lim, rows in sweep
            for r in rows
            if r.name == n and r.plan.fits
        ]
        for n in names
    }
    memory = {r.name: r.plan.result.curve for r in at if r.plan.fits and r.of is None}
    plot_swaps(path, title, curves, memory, base.curve, limit)
