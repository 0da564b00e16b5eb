"""`tidalpool simulate TRACE`: memory policies under a limit, side by side, against a bound.

The trace's steady iteration is extracted and every chosen policy makes its plan
for the limit: swaps, recomputations, and the placement of what they leave on the
device (`combined.fit`: where the placement needs more than the limit, the
schedule is made again for a lower one). A plan counts as feasible only when its
schedule runs under the simulator, passes `validate_swaps`, and its placement
fits the limit. The table (or `--json`) gives, per policy: feasible, overhead
(a fraction of the unconstrained iteration time), the step's ratio to a lower
bound on the step under the limit (`bound.step_bound`), the simulated device
peak and the placed footprint (both with the persistent blocks: weights,
optimizer state), bytes copied each way, bytes recomputed, and the stall. The
`portfolio` row is the best feasible plan of all the policies shown;
`tidalpool`'s own row is its search alone; the `daemon` row is the plan the daemon sends a
session at this limit, which is what a session runs. The unconstrained peak is the
persistent bytes plus the iteration's blocks at their most, which is what
`tidalpool plan` bounds.

A limit under the op-wise bound (the bytes one op needs at once) is refused: no
plan fits it. `--sweep` walks limits from the peak down (steps of `--step` of
the peak) to `--limit` (default: the op-wise bound), printing overhead against
memory per policy (AutoSwap's Figs. 9 and 11); `--plot` draws that curve and the
memory curves (Fig. 8). `--timeline` writes the simulated step of each feasible
plan for Perfetto (`timeline`). Progress goes to stderr.

A trace of several iteration shapes (`tidalpool.torch.record(..., batches=)`, a job's
`step(shape=)`) is simulated shape by shape, each at the one limit a session of that job runs
under: a fraction is of the largest shape's peak. `--shape` picks one. `--buckets` says what
bucketing such inputs costs instead (`buckets`).
Exit status: 0 done, 1 a plan that fails validation (a bug), 2 bad input or an
output that cannot be written, 3 no policy's plan fits (at any limit of a sweep).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidalcore.units import ALIGNMENT, SIZE_HELP, format_size, parse_size
from tidalplan.model import Iteration

from tidaloffline.outputs import output_problem, plural
from tidaloffline.plot import missing_matplotlib

if TYPE_CHECKING:
    from rich.console import Console
    from tidalclient.tables import Fitted
    from tidalcore.events import Events
    from tidalplan.combined import Plan
    from tidalplan.paged import PagedPlan
    from tidalplan.split import BigOp

DEFAULT_STEP = 0.05
NONE_FITS = 3  # the exit status when no policy's plan fits


class InputError(Exception):
    """The trace or an option cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    plan: Plan | PagedPlan  # PagedPlan: the daemon's plan for a paged session (--page)
    bound_ns: int | None  # the lower bound on the step under this limit; None: none fits
    of: str | None = None  # the portfolio row: whose plan it is

    @property
    def ratio(self) -> float | None:
        """The step over the bound, for a feasible plan."""
        if not self.plan.fits or not self.bound_ns:
            return None
        return self.plan.result.iteration_ns / self.bound_ns

    @property
    def reason(self) -> str | None:
        """Why the plan is not feasible (None when it is): its numbers are then those of a
        simulation that stopped where it got stuck, or of a placement over the limit, and
        are shown as none."""
        p = self.plan
        if p.fits:
            return None
        if not p.result.feasible:
            return (
                "its schedule cannot run under the limit (a malloc or a swap-in never fits,"
                " or the blocks live at the start are over it)"
            )
        return (
            f"its placement needs {format_size(p.footprint or 0)}, over the limit"
            f" {format_size(p.limit)}"
            if p.footprint is not None
            else "its placement does not fit the limit"
        )

    def as_json(self) -> dict[str, Any]:
        p = self.plan
        r = p.result
        head: dict[str, Any] = {
            "name": self.name,
            **({"of": self.of} if self.of is not None else {}),
            "feasible": p.fits,
            "schedule_feasible": r.feasible,
            "reason": self.reason,
        }
        numbers = {
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
        if not p.fits:  # an aborted simulation's numbers: nothing but the reason is shown
            numbers = dict.fromkeys(numbers) | {"bound_ns": self.bound_ns}
        return head | numbers


@dataclass(frozen=True, slots=True)
class Facts:
    """What the command knows of the trace before any plan: the bytes and times every
    report names, so that its numbers can be told apart and added up."""

    trace: Path
    peak: int  # device bytes at their most with no limit: persistent + transient
    persistent: int  # blocks live across iterations (weights, optimizer state)
    transient: int  # the iteration's own blocks at their most (`tidalpool plan`'s bound)
    load_min: int  # the least peak swapping alone reaches (AutoSwap)
    op_bound: int  # the most bytes one op touches: no plan fits under it
    biggest: BigOp | None  # that op, as `tidalplan.split.big_ops` sees it just under the bound
    baseline_ns: int  # the step with no limit
    curve: tuple[tuple[int, int], ...]  # (ns, device bytes) of the step with no limit
    out_gbps: float
    in_gbps: float


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `simulate` on an argparse subparsers object; the handler is `run`."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="compare memory policies on a trace under a memory limit",
        description="Make each memory policy's plan (swaps, recomputations, placement) for one"
        " steady iteration of TRACE (a trace CSV v1) under a device memory limit, simulate it,"
        " and compare, beside a lower bound on the step. Every option has a default.",
        epilog="Exit status: 0 done, 1 a plan failed validation (a bug), 2 bad input or an"
        " output that cannot be written, 3 no policy's plan fits the limit (with --sweep: at"
        " any limit).",
    )
    parser.add_argument("trace", type=Path, metavar="TRACE", help="trace CSV v1")
    parser.add_argument(
        "--limit",
        default=None,
        metavar="SIZE|FRACTION",
        help="device memory limit: a size (6GiB, 6442450944 or 6.4e9 bytes; "
        + SIZE_HELP.replace("%", "%%")
        + ") or a fraction of the unconstrained peak (0.6 = 60%%; a number up to 1 is a"
        " fraction, above 1 bytes); default 1.0. With --sweep: the sweep's lowest limit"
        " (default the op-wise bound). A limit under the op-wise bound is refused: no plan fits it",
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
        help=f"one of {', '.join(names_known())}, a comma-separated list, or all (default;"
        f" {DAEMON}: the plan the daemon sends a session)",
    )
    parser.add_argument(
        "--compute-scale",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="multiply op times (default 1)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="walk limits from the peak down to --limit (default: the op-wise bound)",
    )
    parser.add_argument(
        "--step",
        type=float,
        default=DEFAULT_STEP,
        metavar="FRACTION",
        help=f"sweep step as a fraction of the peak (default {DEFAULT_STEP})",
    )
    parser.add_argument(
        "--buckets",
        action="store_true",
        help="of a trace of several shapes that are sizes of one input (sequence lengths,"
        " batch sizes): what each choice of buckets costs, every shape padded to the smallest"
        " bucket that holds it (the daemon's plan of each bucket; plans, step)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="PICTURE.png",
        help="draw the memory curves at the limit (with --sweep: overhead against the limit,"
        " and the memory curves at the lowest limit some plan fits)",
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        metavar="FILE.json",
        help="write the simulated step of each feasible plan in the Chrome trace event format"
        " (open it in ui.perfetto.dev or chrome://tracing); not with --sweep",
    )
    parser.add_argument(
        "--shape",
        default=None,
        help="the iteration shape to take, in a trace of several (tidalpool.torch.record's"
        " batches=, a job's step(shape=)); default: each in turn, at one limit",
    )
    parser.add_argument(
        "--page",
        default=None,
        metavar="SIZE",
        help=f"the {DAEMON} row is the plan the daemon sends a paged session (virtual"
        " residency: every block at one address, the limit counting mapped pages of SIZE,"
        " e.g. 2MiB), its placed bytes the mapped pages at their peak; default: a contiguous"
        " lease's",
    )
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


def _read_trace(path: Path) -> Events | str:
    """The events of the trace CSV at `path`, or, for a file of another format, what it is;
    InputError naming the file when it is missing or cannot be read."""
    from tidaloffline import formats as tracecsv

    if not path.is_file():
        raise InputError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    try:
        kind = tracecsv.detect_format(path, accepted=("trace",))
        if kind != "trace":
            return tracecsv.FORMATS[kind].split(" (")[0]
        return tracecsv.read_trace_csv(path)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:
        raise _named(path, e) from None


def _named(path: Path, e: ValueError) -> InputError:
    text = str(e)
    return InputError(text if str(path) in text else f"{path}: {text}")


def load(path: Path, command: str = "simulate", shape: str | None = None) -> Iteration:
    """The steady iteration of the trace at `path`, of iteration shape `shape` in a trace of
    several (`learn.extract_finished`); InputError naming the file if unusable, and `command`,
    the one that reads it, when it is not a trace."""
    from tidalplan import learn

    from tidaloffline import formats as tracecsv

    events = _read_trace(path)
    if isinstance(events, str):
        raise InputError(
            f"{path}: {events}; {command} reads a trace CSV v1 (header"
            f" {','.join(tracecsv.TRACE_HEADER)}, with ops), as tidalpool.torch.record writes it"
        )
    try:
        it = learn.extract_finished(events, pick_shape(path, events, shape)).iteration
    except ValueError as e:
        raise _named(path, e) from None
    if not it.ops:
        raise InputError(f"{path}: the iteration has no ops: nothing to time")
    return it


def shapes_of(path: Path) -> dict[str, int]:
    """The iteration shapes of the trace at `path`, in the order they first come, each with
    the iterations it marks (one, "", for a trace of one, and for a file of another format,
    which `load` names); InputError naming the file if it cannot be read."""
    from collections import Counter

    from tidalplan import learn

    events = _read_trace(path)
    if isinstance(events, str):
        return {"": 0}
    return dict(Counter(learn.mark_shapes(events, events.marks()))) or {"": 0}


def pick_shape(path: Path, events: Events, shape: str | None) -> str | None:
    """`shape`, or InputError when the trace has several iteration shapes and none is named."""
    from tidalplan import learn

    shapes = learn.shapes(events)
    if shape is None and len(shapes) > 1:
        raise InputError(
            f"{path}: the trace has {len(shapes)} iteration shapes"
            f" ({', '.join(map(repr, shapes))}): pick one with --shape"
        )
    return shape


def parse_limit(text: str, peak: int) -> int:
    """Bytes from '0.6' (a fraction of `peak`), or '6GiB' / '6442450944' / '6.4e9' (bytes: a
    number above 1, in exponent notation too, must be a whole number of them)."""
    accepted = (
        "a size (6GiB, 6442450944, 6.4e9 bytes) or a fraction of the unconstrained peak"
        " (0.6; a number up to 1)"
    )
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and value <= 1.0:
        if not value > 0:
            raise InputError(f"--limit {text}: a fraction must be above 0")
        return int(value * peak)
    if value is not None:
        if not math.isfinite(value):
            raise InputError(f"--limit {text}: not a number of bytes; give {accepted}")
        try:
            exact = Fraction(text.strip())
        except ValueError:  # a form float() reads and Fraction does not ("1_000.5")
            exact = Fraction(value)
        if exact.denominator != 1:
            raise InputError(
                f"--limit {text}: a number above 1 is bytes, and this one is not whole"
            )
        limit = int(exact)
    else:
        try:
            limit = int(parse_size(text))
        except ValueError as e:
            raise InputError(f"--limit {text}: {e}; give {accepted}") from None
    if limit <= 0:
        raise InputError(f"--limit {text}: must be positive")
    if limit >= 2**63:
        raise InputError(f"--limit {text}: {limit} bytes is beyond a 64-bit size")
    return limit


def check_limit(text: str, limit: int, facts: Facts) -> None:
    """InputError when `limit` is under the op-wise bound, which no plan can fit."""
    if limit >= facts.op_bound:
        return
    hint = ""
    try:
        if float(text) > 1:
            hint = " (a number above 1 is bytes; a fraction of the peak is at most 1, e.g. 0.6)"
    except ValueError:
        pass
    op = facts.biggest
    if op is not None and not hint:
        hint = f" ({op.name.removeprefix('aten.').removesuffix('.default')}"
        if op.kind is not None and op.parts is not None:
            hint += f": a {op.kind.replace('_', '-')}, which can run in parts over the batch"
            hint += " (tidalpool.torch.plan_split, docs/torch.md)"
        hint += ")"
    raise InputError(
        f"--limit {text}: {format_size(limit)} is under the op-wise bound"
        f" {format_size(facts.op_bound)} ({facts.op_bound / facts.peak:.0%} of the peak), the"
        f" bytes one op needs at once: no plan fits it{hint}"
    )


DAEMON = "daemon"
"""The row of the plan the daemon sends a session (`wire.session_schedule`, placed as the
daemon places it): what a session really runs, beside the published policies and tidalpool's
search with recomputation, which no session executes."""


def names_known() -> tuple[str, ...]:
    """The names `--policy` takes: the policies, then the daemon's plan."""
    from tidalplan.policies import POLICIES

    return (*POLICIES, DAEMON)


def policies(text: str) -> list[str]:
    known = names_known()
    if text == "all":
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in known:
            raise InputError(f"--policy: unknown policy {n!r}; one of {', '.join(known)}, all")
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
    page: int | None = None,
) -> list[Row]:
    """Every policy's placed plan at one limit (`combined.fit`), each schedule validated, and
    the portfolio: the best feasible of them. `say` hears of each policy as it starts. With
    `page`, the daemon's row is its plan for a paged session (`paged.plan`, pages of `page`
    bytes; Planner I gets `place_s`, or 2 s when 0)."""
    from tidalplan import paged
    from tidalplan.bound import step_bound
    from tidalplan.combined import fit
    from tidalplan.policies import policy
    from tidalplan.wire import session_schedule

    bound = step_bound(it, limit, out_gbps, in_gbps, compute_scale).ns
    rows = []
    for k, name in enumerate(names):
        if say is not None:
            say(f"{name} ({k + 1}/{len(names)})")
        made: Plan | PagedPlan
        if name == DAEMON and page is not None:
            made = paged.plan(
                it,
                session_schedule,
                limit,
                out_gbps,
                in_gbps,
                compute_scale,
                page=page,
                time_limit_s=place_s or 2.0,
            )
        else:
            make = session_schedule if name == DAEMON else policy(name)
            made = fit(it, make, limit, out_gbps, in_gbps, compute_scale, time_limit_s=place_s)
        rows.append(Row(name, made, bound))
    fitting = [r for r in rows if r.plan.fits]
    if len(rows) > 1 and fitting:
        best = min(fitting, key=lambda r: (r.plan.result.iteration_ns, r.plan.footprint or 0))
        rows.append(Row("portfolio", best.plan, bound, of=best.name))
    return rows


def sweep_limits(peak: int, floor: int, step: float) -> list[int]:
    """Limits from `peak` down by `step` × peak while they stay at or above `floor` (a limit
    within a millionth of the peak above it counts as at it: 0.7 is not lost to rounding)."""
    out: list[int] = []
    k = 0
    while True:
        limit = int(peak * (1.0 - k * step))
        if limit < floor - peak // 1_000_000 or limit <= 0:
            return out
        out.append(max(limit, floor))
        k += 1


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def _say(started: float) -> Callable[[str], None]:
    """Progress lines on stderr, each with the seconds since `started`."""

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    return say


def _options(args: argparse.Namespace) -> tuple[float, float, list[str]]:
    """The bandwidths and policies, every number option checked (InputError names it)."""
    out_gbps = args.bandwidth
    in_gbps = args.in_bandwidth if args.in_bandwidth is not None else out_gbps
    if not (0 < out_gbps < float("inf") and 0 < in_gbps < float("inf")):
        raise InputError("--bandwidth and --in-bandwidth must be positive GB/s")
    if not 0 < args.compute_scale < float("inf"):
        raise InputError("--compute-scale must be positive")
    if not 0 < args.step < 1:
        raise InputError("--step must lie in (0, 1)")
    if not 0 <= args.place_time < float("inf"):
        raise InputError("--place-time must be a number of seconds >= 0")
    if args.page is not None:
        try:
            args.page = parse_size(args.page)
        except ValueError as e:
            raise InputError(f"--page: {e}") from None
        if args.page < ALIGNMENT or args.page & (args.page - 1):
            raise InputError(f"--page {args.page} bytes: a power of two of {ALIGNMENT} or more")
    if args.sweep and args.timeline is not None:
        raise InputError("--timeline writes the step at one limit: leave out --sweep")
    for option, path in (("--plot", args.plot), ("--timeline", args.timeline)):
        if why := output_problem(option, path):
            raise InputError(why)
    if args.plot is not None and (why := missing_matplotlib(args.plot)):
        raise InputError(why)
    return out_gbps, in_gbps, policies(args.policy)


def _facts(args: argparse.Namespace, it: Iteration, out_gbps: float, in_gbps: float) -> Facts:
    from tidalplan.autoswap import load as load_curve
    from tidalplan.autoswap import load_min, op_bound
    from tidalplan.learn import live_bytes
    from tidalplan.simulate import no_limit
    from tidalplan.split import big_ops

    base = no_limit(it, args.compute_scale)
    bound = op_bound(it)
    over = big_ops(it, bound - 1) if bound > 1 else ()
    return Facts(
        trace=args.trace,
        peak=int(load_curve(it).max(initial=0)),
        persistent=sum(int(size) for _, size in it.persistent),
        transient=int(live_bytes(it).max(initial=0)),
        load_min=load_min(it),
        op_bound=bound,
        biggest=max(over, key=lambda op: op.touched, default=None),
        baseline_ns=base.baseline_ns,
        curve=base.curve,
        out_gbps=out_gbps,
        in_gbps=in_gbps,
    )


def run(args: argparse.Namespace) -> int:
    """Carry out `tidalpool simulate` with parsed arguments; the exit status."""
    try:
        shapes = shapes_of(args.trace) if args.shape is None else {args.shape: 0}
        if args.buckets and len(shapes) < 2:
            raise InputError(
                "--buckets compares the shapes of a trace of several: "
                + ("leave out --shape" if args.shape is not None else f"{args.trace} has one")
            )
    except InputError as e:
        print(f"tidalpool simulate: {e}", file=sys.stderr)
        return 2
    if len(shapes) > 1:
        return _each_shape(args, shapes)
    return _run(args, _print_json)


def _print_json(document: dict[str, Any]) -> None:
    print(json.dumps(document))


def _each_shape(args: argparse.Namespace, shapes: dict[str, int]) -> int:
    """Every iteration shape of the trace (`shapes_of`) in turn, at the one limit a session of
    the job runs under (a fraction: of the largest shape's peak); with --json, one object of
    them all."""
    from tidalplan.autoswap import load as load_curve

    named = ", ".join(map(repr, shapes))
    try:
        for option, value in (
            ("--sweep", args.sweep),
            ("--plot", args.plot),
            ("--timeline", args.timeline),
        ):
            if value:
                raise InputError(
                    f"{option} shows one iteration shape, and {args.trace} has {len(shapes)}"
                    f" ({named}): pick one with --shape"
                )
        its = {s: load(args.trace, shape=s) for s in shapes}
        peaks = {s: int(load_curve(it).max(initial=0)) for s, it in its.items()}
        largest = max(peaks.values())
        limit = parse_limit(args.limit, largest) if args.limit is not None else None
        if args.buckets:
            out_gbps, in_gbps, _ = _options(args)
    except InputError as e:
        print(f"tidalpool simulate: {e}", file=sys.stderr)
        return 2
    if args.buckets:
        from tidaloffline.buckets import advise, render_advice

        say = _say(time.monotonic())

        def step_of(shape: str, it: Iteration) -> int | None:
            """The step under the daemon's plan at the limit (None: it has none), or with none."""
            if limit is None:
                from tidalplan.simulate import no_limit

                return no_limit(it, args.compute_scale).baseline_ns
            say(f"the daemon's plan of shape {shape!r}")
            (row,) = evaluate(
                it, [DAEMON], limit, out_gbps, in_gbps, args.compute_scale, page=args.page
            )
            return row.plan.result.iteration_ns if row.plan.fits else None

        advice = {
            "trace": str(args.trace),
            "limit_bytes": limit,
            "page_bytes": args.page,
            **advise(its, shapes, step_of),
        }
        if args.json:
            print(json.dumps(advice))
        else:
            render_advice(advice, limit, _console())
        return 0 if any(c["feasible"] for c in advice["choices"]) else NONE_FITS
    documents: list[dict[str, Any]] = []
    status = 0
    for k, shape in enumerate(shapes):
        one = argparse.Namespace(**vars(args))
        one.shape = shape
        one.limit = str(limit) if limit is not None else None
        if not args.json:
            at = "none"
            if limit is not None:
                at = f"{format_size(limit)} ({limit / largest:.0%} of the largest shape's peak)"
            print(
                f"shape {shape!r} ({k + 1} of {len(shapes)}), peak {format_size(peaks[shape])}:"
                f" limit {at}",
                flush=True,
            )

        def keep(document: dict[str, Any], shape: str = shape) -> None:
            documents.append({"shape": shape, **document})

        done = _run(one, keep)
        status = max(status, done)
        if not args.json and k + 1 < len(shapes):
            print()
    if args.json:
        print(json.dumps({"trace": str(args.trace), "limit_bytes": limit, "shapes": documents}))
    return status


def _run(args: argparse.Namespace, emit: Callable[[dict[str, Any]], None]) -> int:
    """`simulate` of one iteration shape; with --json its document goes to `emit`."""
    from tidalplan.validate import InvalidPlacement, InvalidSwapPlan

    try:
        out_gbps, in_gbps, names = _options(args)
        it = load(args.trace, shape=args.shape)
        facts = _facts(args, it, out_gbps, in_gbps)
        default = facts.op_bound if args.sweep else facts.peak
        limit = parse_limit(args.limit, facts.peak) if args.limit is not None else default
        check_limit(args.limit or "", limit, facts)
        if args.sweep and limit > facts.peak:
            raise InputError(
                f"--limit {args.limit}: {format_size(limit)} is above the peak"
                f" {format_size(facts.peak)}, where a sweep starts: with --sweep, --limit is"
                " its lowest limit"
            )
    except InputError as e:
        print(f"tidalpool simulate: {e}", file=sys.stderr)
        return 2
    say = _say(time.monotonic())
    try:
        if args.sweep:
            return _sweep(args, it, facts, names, limit, say, emit)
        return _one(args, it, facts, names, limit, say, emit)
    except (InvalidSwapPlan, InvalidPlacement) as e:
        print(f"tidalpool simulate: a plan failed validation (a bug): {e}", file=sys.stderr)
        return 1
    except OSError as e:
        name = e.filename if e.filename is not None else (args.plot or args.timeline)
        print(f"tidalpool simulate: {name}: cannot write: {e.strerror or e}", file=sys.stderr)
        return 2


def _head(facts: Facts) -> dict[str, Any]:
    return {
        "trace": str(facts.trace),
        "bandwidth_gbps": facts.out_gbps,
        "in_bandwidth_gbps": facts.in_gbps,
        "baseline_ns": facts.baseline_ns,
        "unconstrained_peak_bytes": facts.peak,
        "persistent_bytes": facts.persistent,
        "transient_peak_bytes": facts.transient,
        "load_min_bytes": facts.load_min,
        "op_bound_bytes": facts.op_bound,
    }


def _one(
    args: argparse.Namespace,
    it: Iteration,
    facts: Facts,
    names: list[str],
    limit: int,
    say: Callable[[str], None],
    emit: Callable[[dict[str, Any]], None],
) -> int:
    """The policies at one limit: the table or JSON, and the picture and timeline asked for."""
    rows = evaluate(
        it,
        names,
        limit,
        facts.out_gbps,
        facts.in_gbps,
        args.compute_scale,
        args.place_time,
        say,
        args.page,
    )
    step_bound = rows[0].bound_ns if rows else None
    if args.json:
        head = _head(facts)
        head["compute_scale"] = args.compute_scale
        head["page_bytes"] = args.page  # the daemon row paged in pages of it; null: contiguous
        head["limit_bytes"] = limit
        head["bound_ns"] = step_bound
        head["policies"] = [r.as_json() for r in rows]
        emit(head)
    else:
        console = _console()
        for line in _describe(facts):
            console.print(line, markup=False, highlight=False)
        console.print(_limit_line(limit, facts, step_bound), markup=False, highlight=False)
        console.print(table(rows))
        legend = LEGEND if args.page is None else PAGED_LEGEND
        page = format_size(args.page) if args.page is not None else ""
        text = legend.format(persistent=format_size(facts.persistent), page=page)
        console.print(text, highlight=False)
    if args.plot is not None:
        _draw(args.plot, facts, names, [], rows, limit)
        if not args.json:
            print(f"picture: {args.plot}")
    if args.timeline is not None:
        from tidaloffline.timeline import write

        chosen = [
            (
                f"{r.name}: step {r.plan.result.iteration_ns / 1e6:.2f} ms,"
                f" peak {format_size(r.plan.result.peak_bytes)}",
                r.plan,
            )
            for r in rows
            if r.of is None and r.plan.fits
        ]
        write(args.timeline, it, chosen, facts.out_gbps, facts.in_gbps, args.compute_scale)
        if not args.json:
            plans = plural(len(chosen), "feasible plan")
            print(f"timeline: {args.timeline} ({plans}; open it in ui.perfetto.dev)")
    if not any(r.plan.fits for r in rows):
        share = f" ({limit / facts.peak:.0%} of the peak)" if facts.peak else ""
        print(
            f"tidalpool simulate: no policy's plan fits {format_size(limit)}{share}",
            file=sys.stderr,
        )
        return NONE_FITS
    return 0


def _sweep(
    args: argparse.Namespace,
    it: Iteration,
    facts: Facts,
    names: list[str],
    floor: int,
    say: Callable[[str], None],
    emit: Callable[[dict[str, Any]], None],
) -> int:
    """The policies at every limit of the sweep: the table or JSON, and the picture."""
    grid = sweep_limits(facts.peak, floor, args.step)
    sweep: list[tuple[int, list[Row]]] = []
    for k, lim in enumerate(grid):
        where = f"limit {lim / facts.peak:.2f} of the peak ({k + 1}/{len(grid)})"

        def said(text: str, where: str = where) -> None:
            say(f"{where}: {text}")

        rows = evaluate(
            it,
            names,
            lim,
            facts.out_gbps,
            facts.in_gbps,
            args.compute_scale,
            args.place_time,
            said,
            args.page,
        )
        sweep.append((lim, rows))
    if args.json:
        head = _head(facts)
        head["compute_scale"] = args.compute_scale
        head["page_bytes"] = args.page  # the daemon row paged in pages of it; null: contiguous
        head["sweep"] = [
            {
                "limit_bytes": lim,
                "fraction": lim / facts.peak,
                "bound_ns": rows[0].bound_ns if rows else None,
                "policies": [r.as_json() for r in rows],
            }
            for lim, rows in sweep
        ]
        emit(head)
    else:
        console = _console()
        for line in _describe(facts):
            console.print(line, markup=False, highlight=False)
        console.print(
            f"overhead by limit, {format_size(grid[0])} down to {format_size(grid[-1])}"
            " (—: no feasible placed plan);\nbound: the least overhead a plan can have there",
            markup=False,
            highlight=False,
        )
        console.print(sweep_table(facts, names, sweep))
    if args.plot is not None:
        fitting = [(lim, rows) for lim, rows in sweep if any(r.plan.fits for r in rows)]
        lim, rows = fitting[-1] if fitting else sweep[-1]
        _draw(args.plot, facts, names, sweep, rows, lim)
        if not args.json:
            print(f"picture: {args.plot}")
    if not any(r.plan.fits for _, rows in sweep for r in rows):
        print(
            f"tidalpool simulate: no policy's plan fits any limit from {format_size(grid[0])}"
            f" down to {format_size(grid[-1])}",
            file=sys.stderr,
        )
        return NONE_FITS
    return 0


def _console() -> Console:
    """Standard output at its own width (the terminal's, or 80 columns when piped, or
    $COLUMNS): the tables fit it or fold (`Fitted`)."""
    from rich.console import Console

    return Console()


def _describe(facts: Facts) -> list[str]:
    """The trace's bytes and times, each named with what it counts, in lines of under 80
    columns (a pipe's width), so that no number is wrapped away from its unit."""
    p = facts.peak

    def share(n: int) -> str:
        return f"{n / p:.0%}" if p else "-"

    return [
        f"{facts.trace.name}: one step takes {facts.baseline_ns / 1e6:.2f} ms with no limit",
        f"  copies          {facts.out_gbps:g} GB/s out, {facts.in_gbps:g} GB/s in",
        f"  peak, no limit  {format_size(p)}, the sum of",
        f"    persistent    {format_size(facts.persistent)}: live across iterations (weights,"
        " optimizer)",
        f"    iteration     {format_size(facts.transient)}: its blocks at their most (plan's"
        " bound)",
        f"  load_min        {format_size(facts.load_min)} ({share(facts.load_min)}): the least"
        " peak swapping alone reaches",
        f"  op-wise bound   {format_size(facts.op_bound)} ({share(facts.op_bound)}): the most"
        " bytes one op needs at once",
    ]


def _limit_line(limit: int, facts: Facts, step_bound: int | None) -> str:
    share = f"{limit / facts.peak:.0%}" if facts.peak else "-"
    return f"  limit           {format_size(limit)} ({share}): " + (
        f"no plan's step is under {step_bound / 1e6:.2f} ms here"
        if step_bound is not None
        else "no plan can fit it"
    )


LEGEND = (
    "peak: the simulated device bytes at their highest; placed: the bytes the placed\n"
    "plan needs; both include the {persistent} of persistent blocks. Not feasible:\n"
    "no: stuck (its schedule cannot run under the limit), no: placed X (over it).\n"
    "daemon: the plan the daemon sends a session (swaps alone) and the session runs."
)
PAGED_LEGEND = (
    LEGEND.removesuffix("and the session runs.")
    + "paged in {page}\npages: every block at one address, its placed bytes the mapped pages at"
    " their peak."
)


def table(rows: list[Row]) -> Fitted:
    """The policies at one limit, one row each."""
    from tidalclient.tables import Fitted

    headers = (
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
    )
    cells = []
    for row in rows:
        p = row.plan
        r = p.result
        name = row.name if row.of is None else f"{row.name} ({row.of})"
        if not p.fits:  # its numbers are an aborted simulation's: the reason alone
            why = (
                "no: stuck"
                if not r.feasible
                else f"no: placed {format_size(p.footprint)}"
                if p.footprint is not None
                else "no: placed over"
            )
            cells.append((name, why, *("—",) * (len(headers) - 2)))
            continue
        feasible = "yes" if p.planned_for == p.limit else f"yes, for {format_size(p.planned_for)}"
        cells.append(
            (
                name,
                feasible,
                _percent(r.overhead),
                f"{row.ratio:.3f}" if row.ratio is not None else "—",
                format_size(r.peak_bytes),
                format_size(p.footprint) if p.footprint is not None else "—",
                format_size(r.out_bytes),
                format_size(r.in_bytes),
                format_size(r.recomputed_bytes),
                f"{r.stall_ns / 1e6:.2f} ms",
            )
        )
    return Fitted(headers, cells, left=(0,))


def sweep_table(facts: Facts, names: list[str], sweep: list[tuple[int, list[Row]]]) -> Fitted:
    """Overhead per policy (a column each) at each limit of the sweep (a row each)."""
    from tidalclient.tables import Fitted

    cells = []
    for lim, rows in sweep:
        by_name = {r.name: r for r in rows}
        b = rows[0].bound_ns if rows else None
        base = facts.baseline_ns
        cells.append(
            (
                f"{format_size(lim)} ({lim / facts.peak:.0%})",
                _percent(b / base - 1) if b is not None and base else "—",
                *(
                    _percent(by_name[n].plan.result.overhead) if by_name[n].plan.fits else "—"
                    for n in names
                ),
            )
        )
    return Fitted(("limit", "bound", *names), cells, left=(0,))


def _draw(
    path: Path,
    facts: Facts,
    names: list[str],
    sweep: list[tuple[int, list[Row]]],
    at: list[Row],
    limit: int,
) -> None:
    """The picture: overhead against the limit (a sweep's), and memory curves at `limit`."""
    from tidaloffline.plot import plot_swaps

    curves = {
        n: [
            (lim / facts.peak, r.plan.result.overhead)
            for lim, rows in sweep
            for r in rows
            if r.name == n and r.plan.fits
        ]
        for n in names
    }
    memory = {r.name: r.plan.result.curve for r in at if r.plan.fits and r.of is None}
    plot_swaps(path, facts.trace.name, curves, memory, facts.curve, limit, facts.peak)
