"""Placement heights and times: tidalpool's solver against SmartPool and the lower bound.

Three sets of instances:
  1. MiniMalloc's challenging benchmarks A-K (../shared/traces/minimalloc/challenging): 154-454
     buffers, alignment 1; nine have a packing at their peak load.
  2. The steady iteration of every model trace (../shared/traces/models), alignment 256.
  3. Scale: the densenet121 iteration tiled to 100,000 buffers, copies one iteration apart
     (as training repeats them), and a harder variant with copies 3/4 of an iteration apart,
     so that each overlaps the next; both under a time limit of at most 5 s.

For each: buffers, the lower bound (peak of live bytes), SmartPool's height (best fit in
decreasing size) and its seconds, tidalpool's height, height / bound, seconds of `solve`
(lower bound included) and whether the plan is proven optimal. Every placement is checked
by the validator. `--no-exact` runs the heuristics alone.

    .venv/bin/python bench/placement.py [--json] [--time-limit S] [--no-exact] [--traces DIR]

The instances are read from DIR (default ../shared/traces, beside this repository); without
them the script says what is missing and where to get it, and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tidalcore.units import Tick
from tidaloffline.formats import read_problem_csv
from tidalplan.model import Buffer, Problem
from tidalplan.placement import lower_bound, smartpool, solve
from tidalplan.validate import validate

SHARED = Path(__file__).resolve().parents[2] / "shared/traces"
CHALLENGING = "minimalloc/challenging"  # under the traces directory
MODELS = "models"
WHERE = {
    CHALLENGING: "MiniMalloc's challenging instances, *.csv: the benchmarks/challenging folder of"
    " github.com/google/minimalloc",
    MODELS: "model traces, *.trace.csv: recorded by tidalpool.torch.record (traces/record.py"
    " --out DIR records the sample models; docs/torch.md)",
}
SCALE_TRACE = "densenet121.b32.trace.csv"
SCALE_BUFFERS = 100_000
SCALE_TIME_LIMIT = 5.0  # the target: 100,000 buffers within 5 s


@dataclass
class Row:
    group: str
    instance: str
    buffers: int
    lower_bound: int
    smartpool: int
    smartpool_s: float
    height: int
    ratio: float
    seconds: float
    optimal: bool
    solver: str


def steady_iteration(path: Path) -> tuple[Problem, int] | None:
    """The trace's steady iteration as a problem (alignment 256) and its ticks; None without
    the learn module."""
    try:
        from tidaloffline.formats import read_trace_csv
        from tidalplan.learn import extract, to_problem
    except ImportError:
        return None
    events = read_trace_csv(path)
    iteration = extract(events, events.marks())
    problem, _ = to_problem(iteration, alignment=256)
    return problem, iteration.ticks


def tiled(problem: Problem, shift: int, count: int) -> Problem:
    """Copies of the problem, each `shift` ticks after the last, cut at `count` buffers."""
    buffers: list[Buffer] = []
    copy = 0
    while len(buffers) < count:
        for b in problem.buffers[: count - len(buffers)]:
            lower, upper = b.lower + copy * shift, b.upper + copy * shift
            buffers.append(Buffer(len(buffers), Tick(lower), Tick(upper), b.size))
        copy += 1
    return Problem(tuple(buffers), problem.alignment)


def measure(group: str, name: str, problem: Problem, time_limit: float, exact: bool) -> Row:
    started = time.perf_counter()
    baseline = smartpool(problem)
    baseline_s = time.perf_counter() - started
    started = time.perf_counter()
    placed = solve(problem, time_limit_s=time_limit, use_exact=exact)
    seconds = time.perf_counter() - started
    validate(problem, placed)
    validate(problem, baseline)
    bound = lower_bound(problem)
    return Row(
        group=group,
        instance=name,
        buffers=len(problem.buffers),
        lower_bound=bound,
        smartpool=baseline.height,
        smartpool_s=round(baseline_s, 3),
        height=placed.height,
        ratio=round(placed.height / bound, 5),
        seconds=round(seconds, 3),
        optimal=placed.optimal,
        solver=placed.solver,
    )


def missing(traces: Path) -> list[str]:
    """What the benchmark lacks under `traces`, a line each naming the folder, what belongs
    there and where it comes from (none: every set is there)."""
    lines = []
    for folder, pattern in ((CHALLENGING, "*.csv"), (MODELS, "*.trace.csv")):
        path = traces / folder
        if not any(path.glob(pattern)):
            state = "no such directory" if not path.is_dir() else f"no {pattern} in it"
            lines.append(f"  {path} ({state}): {WHERE[folder]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    parser.add_argument("--time-limit", type=float, default=10.0, metavar="S")
    parser.add_argument("--no-exact", action="store_true", help="heuristics only")
    parser.add_argument("--skip-scale", action="store_true", help="leave out the 100k instances")
    parser.add_argument(
        "--traces",
        type=Path,
        default=SHARED,
        metavar="DIR",
        help="the instances' directory: minimalloc/challenging/*.csv and models/*.trace.csv"
        f" (default {SHARED})",
    )
    args = parser.parse_args(argv)
    if lacking := missing(args.traces):
        print(
            f"bench/placement.py: instances are missing from {args.traces} (the shared data"
            " beside this repository, or --traces DIR):\n" + "\n".join(lacking),
            file=sys.stderr,
        )
        return 2
    exact = not args.no_exact
    if exact:
        try:
            import tidalplan.exact  # noqa: F401
        except ImportError:
            print("note: tidalplan.exact is not importable: heuristics only", file=sys.stderr)
    rows: list[Row] = []

    def emit(row: Row) -> None:
        rows.append(row)
        if not args.json:
            print(
                f"{row.group:<11} {row.instance:<26} {row.buffers:>7} {row.lower_bound:>12}"
                f" {row.smartpool:>12} {row.smartpool / row.lower_bound:>7.4f}"
                f" {row.smartpool_s:>6.2f}"
                f" {row.height:>12} {row.ratio:>7.4f} {row.seconds:>6.2f}"
                f" {'yes' if row.optimal else 'no':>7}  {row.solver}",
                flush=True,
            )

    if not args.json:
        print(
            f"{'group':<11} {'instance':<26} {'buffers':>7} {'lower bound':>12}"
            f" {'smartpool':>12} {'ratio':>7} {'s':>6} {'tidalpool':>12} {'ratio':>7} {'s':>6}"
            f" {'optimal':>7}  solver"
        )
    for path in sorted((args.traces / CHALLENGING).glob("*.csv")):
        name = path.name.split(".")[0]
        emit(measure("challenging", name, read_problem_csv(path), args.time_limit, exact))

    base: tuple[Problem, int] | None = None
    for path in sorted((args.traces / MODELS).glob("*.trace.csv")):
        loaded = steady_iteration(path)
        if loaded is None:
            print("note: tidalplan.learn is missing: model traces skipped", file=sys.stderr)
            break
        name = path.name.removesuffix(".trace.csv")
        emit(measure("model", name, loaded[0], args.time_limit, exact))
        if path.name == SCALE_TRACE:
            base = loaded

    if base is not None and not args.skip_scale:
        problem, ticks = base
        for label, shift in (("tiled", ticks), ("tiled 3/4 apart", ticks * 3 // 4)):
            instance = tiled(problem, shift, SCALE_BUFFERS)
            limit = min(args.time_limit, SCALE_TIME_LIMIT)
            name = f"{SCALE_TRACE.split('.')[0]} {label}"
            emit(measure("scale", name, instance, limit, exact))

    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
