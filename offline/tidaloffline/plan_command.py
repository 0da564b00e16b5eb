"""`tidalpool plan INPUT`: place the buffers of a problem, a trace or a snapshot, and report.

INPUT is a placement CSV (MiniMalloc's `id,lower,upper,size`), a trace CSV v1
(its steady iteration is extracted and placed: the last one the next repeats,
`learn.extract_finished`, named on the `steady:` line) or a PyTorch memory
snapshot pickle. The command prints the lower bound, SmartPool's height, the solver's
height, their ratios to the bound, the seconds and whether the plan is proven
optimal; `--out` writes `id,lower,upper,size,offset`; `--plot` draws the
placement, the largest blocks named; `--json` prints the report as one JSON object.
Output paths are checked before the solve. Every placement is validated before it is
printed or written.

For a trace, what is placed is the iteration's own blocks (the arena); the
persistent blocks (weights, optimizer state: live across iterations) stay
outside it. The report gives their bytes and the sums, so that the bound plus
the persistent bytes is the unconstrained peak `tidalpool simulate` reports.
A trace of several iteration shapes (`tidalpool.torch.record(..., batches=)`, a job's
`step(shape=)`) is placed shape by shape (with `--json`, one object of them all); `--shape`
picks one.
Progress goes to stderr once a solve has run for a second. Exit status: 0 done,
1 an invalid placement (a bug), 2 bad input or options.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tidalcore.units import ALIGNMENT, format_size
from tidalplan.model import Placement, Problem
from tidalplan.placement import SMARTPOOL_MAX_BUFFERS, lower_bound, smartpool, solve
from tidalplan.validate import InvalidPlacement, validate

from tidaloffline.outputs import output_problem, plural
from tidaloffline.plot import ANNOTATED, missing_matplotlib

PROGRESS_AFTER_S = 1.0


class InputError(Exception):
    """The input or an option cannot be used; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class Loaded:
    problem: Problem
    labels: tuple[str, ...] | None  # ids to write, when they differ from Buffer.id
    kind: str  # "placement CSV", "trace CSV" or "memory snapshot"
    names: tuple[str, ...] | None = None  # what the picture calls each buffer
    persistent: tuple[int, int] | None = None  # a trace's persistent blocks: count, bytes
    steady: str | None = None  # which iteration of a trace is placed, and why that one
    iteration: int | None = None  # a trace's: the index of the iteration placed
    peak: int | None = None  # a trace's: its blocks' live bytes at their most (simulate's)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plan` on an argparse subparsers object; the handler is `run`."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="place the blocks of a trace, snapshot or placement CSV, and compare",
        description="Place the buffers of INPUT (a placement CSV, a trace CSV v1 or a PyTorch"
        " memory snapshot) and compare with the lower bound and SmartPool.",
    )
    parser.add_argument(
        "input", type=Path, metavar="INPUT", help="placement CSV, trace or snapshot"
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds the solver may spend (default 10)",
    )
    parser.add_argument("--out", type=Path, metavar="SOLUTION.csv", help="write the placement")
    parser.add_argument("--plot", type=Path, metavar="PICTURE.png", help="draw the placement")
    parser.add_argument(
        "--annotate",
        type=int,
        default=ANNOTATED,
        metavar="N",
        help=f"name the N largest blocks on the picture (default {ANNOTATED}; 0: none)",
    )
    parser.add_argument(
        "--shape",
        default=None,
        help="of a trace of several iteration shapes, the one to place (default: each in turn)",
    )
    parser.add_argument(
        "--alignment",
        type=int,
        default=None,
        metavar="BYTES",
        help=f"offset alignment, a power of two up to 1 GiB (default {ALIGNMENT} for traces and"
        " snapshots, the file's own (1 unless it has an alignment column) for placement CSVs)",
    )
    parser.add_argument("--no-exact", action="store_true", help="heuristics only, no exact search")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)
    return parser


def load(path: Path, alignment: int | None, shape: str | None = None) -> Loaded:
    """The problem in `path`, whatever its format (InputError naming the file if unusable)."""
    from tidaloffline import formats as tracecsv  # lazily: the CLI starts fast

    if alignment is not None and (alignment < 1 or alignment & (alignment - 1)):
        raise InputError(f"--alignment must be a power of two (1, 2, 4, ...), got {alignment}")
    if alignment is not None and alignment > tracecsv.MAX_ALIGNMENT:
        raise InputError(
            f"--alignment {alignment}: at most {tracecsv.MAX_ALIGNMENT} (1 GiB), so that sizes"
            " rounded up to it stay within 64 bits"
        )
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not path.is_file():
        raise InputError(f"{path}: not a file")
    try:
        kind = tracecsv.detect_format(path)
        if kind == "problem":
            problem, labels = tracecsv.read_problem_csv_with_labels(path)
            a = alignment if alignment is not None else problem.alignment
            return Loaded(Problem(problem.buffers, a), labels, "placement CSV", names=labels)
        a = alignment if alignment is not None else ALIGNMENT
        if kind == "trace":
            from tidalplan import learn

            from tidaloffline.simulate_command import pick_shape

            events = tracecsv.read_trace_csv(path)
            chosen = learn.extract_finished(events, pick_shape(path, events, shape))
            iteration = chosen.iteration
            problem, mapping = learn.to_problem(iteration, alignment=a)
            labels = tuple(str(iteration.blocks[i].id) for i in mapping)
            return Loaded(
                problem,
                labels,
                "trace CSV",
                names=tuple(f"block {label}" for label in labels),
                persistent=(
                    len(iteration.persistent),
                    sum(int(size) for _, size in iteration.persistent),
                ),
                steady=str(chosen),
                iteration=iteration.index,
                peak=int(learn.live_bytes(iteration).max(initial=0)),
            )
        problem = tracecsv.read_snapshot(path)
        return Loaded(Problem(problem.buffers, a), None, "memory snapshot")
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:  # FormatError, NoIteration, bad values
        text = str(e)
        raise InputError(text if str(path) in text else f"{path}: {text}") from None


class _Progress:
    """Prints the solver's lines to `stream` once `after` seconds have passed (held until then)."""

    def __init__(self, stream: TextIO, clock: Callable[[], float], after: float) -> None:
        self.stream, self.clock, self.after = stream, clock, after
        self.start = clock()
        self.held: list[tuple[float, str]] = []

    def __call__(self, message: str) -> None:
        elapsed = self.clock() - self.start
        self.held.append((elapsed, message))
        if elapsed >= self.after:
            for at, line in self.held:
                print(f"[{at:6.1f} s] {line}", file=self.stream, flush=True)
            self.held.clear()


def run(
    args: argparse.Namespace,
    out: TextIO | None = None,
    err: TextIO | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """Carry out `tidalpool plan` with parsed arguments; the exit status."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if args.shape is None:
        from tidaloffline import simulate_command

        try:
            shapes = list(simulate_command.shapes_of(args.input))
        except simulate_command.InputError:
            shapes = []  # not a file that can be read: `load` below says why
        if len(shapes) > 1:
            return _each_shape(args, shapes, out, err, clock)
    try:
        if not args.time_limit > 0:
            raise InputError(f"--time-limit must be positive, got {args.time_limit}")
        if args.annotate < 0:
            raise InputError(f"--annotate must be 0 or more, got {args.annotate}")
        for option, path in (("--out", args.out), ("--plot", args.plot)):
            if why := output_problem(option, path):
                raise InputError(why)
        if args.plot is not None and (why := missing_matplotlib(args.plot)):
            raise InputError(why)
        loaded = load(args.input, args.alignment, args.shape)
    except InputError as e:
        print(f"tidalpool plan: {e}", file=err)
        return 2

    problem = loaded.problem
    bound = lower_bound(problem)
    baseline = None
    if len(problem.buffers) <= SMARTPOOL_MAX_BUFFERS:
        baseline = smartpool(problem)
    started = clock()
    placement = solve(
        problem,
        time_limit_s=args.time_limit,
        use_exact=not args.no_exact,
        progress=_Progress(err, clock, PROGRESS_AFTER_S),
    )
    seconds = clock() - started
    try:
        validate(problem, placement)
        if baseline is not None:
            validate(problem, baseline)
    except InvalidPlacement as e:
        print(f"tidalpool plan: {args.input}: invalid placement, not used: {e}", file=err)
        return 1

    report = _report(args, loaded, bound, baseline, placement, seconds)
    if not args.json:
        _print(report, out)
    try:
        if args.out is not None:
            from tidaloffline.formats import write_solution_csv

            write_solution_csv(args.out, problem, placement, loaded.labels)
            report["solution"] = str(args.out)
            if not args.json:
                print(f"solution: {args.out}", file=out)
        if args.plot is not None:
            from tidaloffline.plot import plot

            title = f"{args.input.name}: {placement.solver}, height {format_size(placement.height)}"
            plot(problem, placement, args.plot, title, loaded.names, args.annotate)
            report["picture"] = str(args.plot)
            if not args.json:
                print(f"picture: {args.plot}", file=out)
    except OSError as e:
        name = e.filename if e.filename is not None else (args.out or args.plot)
        print(f"tidalpool plan: {name}: cannot write: {e.strerror or e}", file=err)
        return 2
    if args.json:
        print(json.dumps(report), file=out)
    return 0


def _each_shape(
    args: argparse.Namespace,
    shapes: list[str],
    out: TextIO,
    err: TextIO,
    clock: Callable[[], float],
) -> int:
    """Every iteration shape of the trace placed in turn; with --json, one object of them all."""
    for option, value in (("--out", args.out), ("--plot", args.plot)):
        if value is not None:
            print(
                f"tidalpool plan: {option} writes one iteration shape's placement, and"
                f" {args.input} has {len(shapes)} ({', '.join(map(repr, shapes))}): pick one"
                " with --shape",
                file=err,
            )
            return 2
    reports: list[dict[str, Any]] = []
    status = 0
    for k, shape in enumerate(shapes):
        one = argparse.Namespace(**vars(args))
        one.shape = shape
        if args.json:
            text = io.StringIO()
            status = max(status, run(one, text, err, clock))
            if text.getvalue():
                reports.append({"shape": shape, **json.loads(text.getvalue())})
        else:
            print(f"shape {shape!r} ({k + 1} of {len(shapes)})", file=out)
            status = max(status, run(one, out, err, clock))
            if k + 1 < len(shapes):
                print(file=out)
    if args.json:
        print(json.dumps({"input": str(args.input), "shapes": reports}), file=out)
    return status


def _report(
    args: argparse.Namespace,
    loaded: Loaded,
    bound: int,
    baseline: Placement | None,
    placement: Placement,
    seconds: float,
) -> dict[str, Any]:
    """What the command found, as `--json` prints it (and the text report, line by line)."""

    def ratio(height: int) -> float | None:
        return height / bound if bound else None

    count, persistent = loaded.persistent if loaded.persistent is not None else (None, None)
    return {
        "input": str(args.input),
        "format": loaded.kind,
        "iteration": loaded.iteration,
        "steady": loaded.steady,
        "buffers": len(loaded.problem.buffers),
        "alignment": loaded.problem.alignment,
        "lower_bound_bytes": bound,
        "persistent_blocks": count,
        "persistent_bytes": persistent,
        "peak_bytes": None if loaded.peak is None else loaded.peak + (persistent or 0),
        "smartpool_bytes": baseline.height if baseline is not None else None,
        "smartpool_ratio": ratio(baseline.height) if baseline is not None else None,
        "height_bytes": placement.height,
        "ratio": ratio(placement.height),
        "solver": placement.solver,
        "seconds": seconds,
        "optimal": placement.optimal,
        "solution": None,
        "picture": None,
    }


def _print(report: dict[str, Any], out: TextIO) -> None:
    """The report as lines of text, each naming what its number counts."""
    bound = report["lower_bound_bytes"]
    persistent = report["persistent_bytes"]

    def ratio(x: float | None) -> str:
        return f"{x:.4f}" if x is not None else "-"

    print(f"input: {report['input']} ({_description(report)})", file=out)
    if report["steady"] is not None:
        print(f"steady: {report['steady']}", file=out)
    if persistent is None:
        print(f"lower bound: {bound} B ({format_size(bound)})", file=out)
    else:
        blocks = plural(report["persistent_blocks"], "block")
        print(
            f"lower bound: {bound} B ({format_size(bound)}): the arena, the iteration's blocks"
            " at their most",
            file=out,
        )
        print(
            f"persistent: {persistent} B ({format_size(persistent)}): {blocks} kept across"
            " iterations, outside the arena",
            file=out,
        )
        peak = report["peak_bytes"]
        said = (
            "the peak tidalpool simulate reports"
            if peak == bound + persistent
            else f"over the {format_size(peak)} peak tidalpool simulate reports (sizes rounded"
            " up to the alignment; a block live across every cut of the iteration placed over"
            " all of it)"
        )
        print(
            f"lower bound + persistent: {bound + persistent} B"
            f" ({format_size(bound + persistent)}): {said}",
            file=out,
        )
    if report["smartpool_bytes"] is not None:
        print(
            f"smartpool: {report['smartpool_bytes']} B (ratio {ratio(report['smartpool_ratio'])})",
            file=out,
        )
    else:
        print(
            f"smartpool: skipped ({plural(report['buffers'], 'buffer')}; it is quadratic,"
            f" run up to {SMARTPOOL_MAX_BUFFERS})",
            file=out,
        )
    height = report["height_bytes"]
    print(f"height: {height} B (ratio {ratio(report['ratio'])}, {report['solver']})", file=out)
    if persistent is not None:
        total = height + persistent
        print(
            f"height + persistent: {total} B ({format_size(total)}): the device bytes under"
            " this placement",
            file=out,
        )
    print(f"seconds: {report['seconds']:.2f}", file=out)
    print(f"optimal: {'yes' if report['optimal'] else 'no'}", file=out)


def _description(report: dict[str, Any]) -> str:
    """The input's kind, its buffers and alignment: "trace CSV, iteration 1: 23 buffers,
    alignment 256"."""
    kind = report["format"]
    if report["iteration"] is not None:
        kind += f", iteration {report['iteration']}:"
    else:
        kind += ","
    return f"{kind} {plural(report['buffers'], 'buffer')}, alignment {report['alignment']}"


def main(argv: list[str] | None = None) -> int:
    """`python -m tidaloffline.plan_command INPUT ...`: the command on its own."""
    parser = argparse.ArgumentParser(prog="tidalpool")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
