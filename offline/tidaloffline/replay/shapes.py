"""`tidalpool replay` of a trace of several iteration shapes: every shape in one session.

A job whose iterations differ in shape names each with `step(shape=)`; the daemon plans each
shape apart and the session switches plans at every step. This replays such a job: each shape's
steady iteration `--iterations` times, in a random order (`--seed`), in one session under one
limit (a fraction is of the largest shape's peak), its persistent blocks shared by the shapes
that have them. Each shape learns for its first iterations; before its first iteration after
them, the replay waits for that shape's plan (`--plan-timeout`), as the replay of one shape
does; a shape the daemon cannot plan (it says why) or whose plan does not come runs no more.
Each shape is then reported as the replay of one: its iterations, and its steady iterations
against the simulator's prediction for its plan.

A block of one shape's iteration freed in the next (it crosses the boundary) would be freed in
an iteration of another shape: such a trace is refused here (replay one shape with --shape).

`--recognise-shapes`: the steps name no shape; the session (`recognise_shapes=True`) tells each
iteration's shape from its first allocation (`auto-<bytes>`), and each iteration is checked to
have been told the one of its shape. Shapes whose iterations begin with allocations of one size
would be told as one: such a trace is refused with that option.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidalcore.units import format_size

from tidaloffline.replay.errors import ReplayError
from tidaloffline.replay.replayer import Replayer
from tidaloffline.replay.report import Report, plan_of, render, show_ms, show_size
from tidaloffline.replay.session import (
    LEARNING_ITERATIONS,
    check_backend,
    check_options,
    compute_of,
    open_session,
    private_daemon,
    refuse,
    say_from,
)
from tidaloffline.simulate_command import InputError, load, parse_limit

if TYPE_CHECKING:
    from tidalclient.session import Session
    from tidalplan.model import Iteration


def run(args: argparse.Namespace, shapes: list[str], socket_dir: Path | None) -> int:
    """Replay every shape of the trace in one session; the exit status, as `replay`'s."""
    from rich.console import Console
    from tidalplan.autoswap import load as load_curve
    from tidalplan.autoswap import op_bound

    try:
        check_options(args)
        if args.timeline is not None:
            raise InputError(
                f"--timeline writes one iteration shape's run, and {args.trace} has"
                f" {len(shapes)} ({', '.join(map(repr, shapes))}): pick one with --shape"
            )
        its = {s: load(args.trace, "replay", s) for s in shapes}
        for s, it in its.items():
            crossing = sum(b.crosses for b in it.blocks)
            if crossing:
                raise InputError(
                    f"{args.trace}: {crossing} blocks of shape {s!r} are freed in the iteration"
                    " after theirs, which here would be another shape's: replay that shape alone"
                    " with --shape"
                )
        if args.recognise_shapes:
            _check_told_apart(its)
        peaks = {s: int(load_curve(it).max(initial=0)) for s, it in its.items()}
        largest = max(peaks.values())
        limit = parse_limit(args.limit, largest)
        for s, it in its.items():
            bound = op_bound(it)
            if limit < bound:
                raise InputError(
                    f"--limit {args.limit} ({format_size(limit)}) is below {format_size(bound)},"
                    f" the bytes one op of shape {s!r} accesses at once: no plan fits it"
                )
        check_backend(args, socket_dir)
    except (InputError, ReplayError) as e:
        refuse(e)
        return 2
    reports = {
        s: Report(
            trace=str(args.trace),
            backend=args.backend,
            daemon=str(socket_dir) if socket_dir is not None else "started",
            limit_bytes=limit,
            peak_bytes=peaks[s],
            op_bound_bytes=op_bound(its[s]),
            compute_scale=args.compute_scale,
            copy_gbps=args.copy_gbps,
            page_bytes=args.page or 0,
        )
        for s in shapes
    }
    order = [s for s in shapes for _ in range(args.iterations)]
    random.Random(args.seed).shuffle(order)
    say = say_from(time.monotonic())
    ran: list[str] = []
    try:
        with contextlib.ExitStack() as stack:
            directory = socket_dir
            if directory is None:
                directory = stack.enter_context(private_daemon(args.backend, largest, say))
            ran = _replay(args, its, order, reports, Path(directory), say)
    except ReplayError as e:
        refuse(e)
        return e.status
    if args.json:
        print(
            json.dumps(
                {
                    "trace": str(args.trace),
                    "limit_bytes": next(iter(reports.values())).limit_bytes,
                    "seed": args.seed,
                    "order": ran,
                    "shapes": [{"shape": s, **r.as_json()} for s, r in reports.items()],
                }
            )
        )
    else:
        console = Console()
        for k, (s, report) in enumerate(reports.items()):
            console.print(
                f"shape {s!r} ({k + 1} of {len(reports)}): {len(report.records)} iterations",
                highlight=False,
            )
            render(report, console)
            if k + 1 < len(reports):
                console.print()
    failed = [s for s, report in reports.items() if report.outcome != "compared"]
    for s in failed:
        refuse(f"shape {s!r}: {reports[s].outcome}")
    if failed:
        return 2
    checks = [report.checks() for report in reports.values()]
    return 1 if any(c["mismatches"] or c["not_resident"] for c in checks) else 0


def told(it: Iteration) -> str:
    """The shape a session that recognises shapes tells an iteration of `it`."""
    from tidalclient.session import auto_shape

    return auto_shape(int(it.blocks[0].size) if it.blocks else None)


def _check_told_apart(its: dict[str, Iteration]) -> None:
    """InputError when two shapes would be told as one (their first allocations' sizes)."""
    seen: dict[str, str] = {}
    for s, it in its.items():
        key = told(it)
        if key in seen:
            raise InputError(
                f"shapes {seen[key]!r} and {s!r} both begin with {key.removeprefix('auto-')}"
                " bytes allocated: a session recognising shapes tells them as one; replay them"
                " without --recognise-shapes (their steps named)"
            )
        seen[key] = s


def _replay(
    args: argparse.Namespace,
    its: dict[str, Iteration],
    order: list[str],
    reports: dict[str, Report],
    directory: Path,
    say: Callable[[str], None],
) -> list[str]:
    """Run `order` in one session; fill each shape's report; the shapes as they ran."""
    from tidalclient.errors import LeaseExceeded, SessionClosed

    first = next(iter(reports.values()))
    largest = max(r.peak_bytes for r in reports.values())
    session, limit = open_session(args, directory, first.limit_bytes, largest, say)
    ran: list[str] = []
    with session:
        backend = "sim" if session.cuda is None else "cuda"
        compute = compute_of(session)
        recognise = args.recognise_shapes
        keys = {s: told(it) if recognise else s for s, it in its.items()}  # the session's names
        replayers = {
            s: Replayer(session, it, compute, args.compute_scale, shape="" if recognise else s)
            for s, it in its.items()
        }
        shared: dict[int, Any] = {}
        for replayer in replayers.values():
            replayer.setup(shared)
        stopped: set[str] = set()
        try:
            for shape in order:
                if shape in stopped:
                    continue
                replayer = replayers[shape]
                if len(replayer.records) == LEARNING_ITERATIONS and not _planned(
                    session, keys[shape], args.plan_timeout, reports[shape], say
                ):
                    stopped.add(shape)
                    continue
                r = replayer.iteration()
                if session.shape != keys[shape]:
                    raise ReplayError(
                        f"iteration {len(ran)} of shape {shape!r} was told as"
                        f" {session.shape!r}, not {keys[shape]!r}"
                    )
                ran.append(shape)
                say(
                    f"{shape} iteration {r.index} ({r.phase}): {show_ms(r.step_ns)}, out"
                    f" {show_size(r.planned_out_bytes)} planned"
                    f" + {show_size(r.on_demand_out_bytes)} on demand,"
                    f" in {show_size(r.planned_in_bytes)} + {show_size(r.on_demand_in_bytes)}"
                )
        except LeaseExceeded as e:  # in an iteration of `shape`
            raise ReplayError(f"iteration {len(ran)} (shape {shape!r}): {e}", 1) from None
        except SessionClosed as e:
            raise ReplayError(f"the daemon ended the session: {e}") from None
        swap = session.executor.stats().swap
        for s, report in reports.items():
            replayer = replayers[s]
            report.backend = backend
            report.limit_bytes = limit
            report.records = replayer.records
            report.unresolved_accesses = replayer.script.unresolved
            report.missing_accesses = replayer.missing
            report.peak_resident_bytes = swap.peak_resident_bytes if swap is not None else 0
            report.plan, report.predicted = plan_of(session, keys[s])
            if report.outcome == "compared" and not report.steady():
                report.outcome = (
                    "its plan arrived but no steady iteration of it ran"
                    if report.plan is not None
                    else "no plan arrived"
                )
    return ran


def _planned(
    session: Session, shape: str, timeout_s: float, report: Report, say: Callable[[str], None]
) -> bool:
    """Wait for the plan of `shape` (at most `timeout_s`); False, with the report's outcome
    saying why, when the daemon cannot make one or it did not come."""
    if shape in session.plans:
        return True
    say(f"waiting up to {timeout_s:g} s for the daemon's plan of shape {shape!r}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if shape in session.plans:
            return True
        told = session.plan_unavailable
        if told is not None and told.shape == shape:
            report.plan_unavailable = asdict(told)
            report.outcome = told.line()
            return False
        time.sleep(0.02)
    report.outcome = (
        f"no plan of shape {shape!r} arrived within {timeout_s:g} s after"
        f" {LEARNING_ITERATIONS} of its iterations"
    )
    return False
