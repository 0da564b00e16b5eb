"""`tidalpool replay TRACE --limit L`: the command, its options, and the rule of its iterations.

The first three iterations learn (the daemon plans after three step marks); before the
fourth, the command waits for the plan (`--plan-timeout`). The first iteration run by the plan
is the switch (blocks placed while learning move to their places); the ones after it are the
steady iterations that are averaged. When the daemon says it cannot make a plan
(`PlanUnavailable`), the wait ends at once and the run ends with its reason. Exit status: 0
compared, 1 the checks found wrong bytes or an access off the device, or the plan could not run;
2 bad input, no daemon, or no plan executed (the daemon's refusal included). A trace of several
iteration shapes is replayed shape by shape in one session (`shapes`) unless --shape picks one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidalcore.units import format_size

from tidaloffline.replay.compute import Compute
from tidaloffline.replay.errors import ReplayError
from tidaloffline.replay.replayer import Replayer
from tidaloffline.replay.report import Report, plan_of, render, show_ms, show_size
from tidaloffline.replay.session import (
    DEFAULT_ITERATIONS,
    DEFAULT_PLAN_TIMEOUT_S,
    EXTRA_ITERATIONS,
    LEARNING_ITERATIONS,
    MIN_ITERATIONS,
    check_backend,
    check_options,
    compute_of,
    open_session,
    private_daemon,
    refuse,
    say_from,
)
from tidaloffline.simulate_command import InputError, load, parse_limit, shapes_of

if TYPE_CHECKING:
    from tidalclient.session import Session
    from tidalclient.timeline import Timeline
    from tidalplan.model import Iteration
    from tidalplan.wire import Simulated


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `replay` on an argparse subparsers object; the handler is `run`."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "replay",
        help="run a trace's steady iteration against a daemon and compare with the prediction",
        description="Run the steady iteration of TRACE (a trace CSV v1) in a session under a"
        " device memory limit, as a training job would, with each op a timed wait on the"
        " compute stream, and print what happened beside the simulator's prediction for the"
        " daemon's plan.",
    )
    parser.add_argument("trace", type=Path, metavar="TRACE", help="trace CSV v1")
    parser.add_argument(
        "--limit",
        required=True,
        metavar="BYTES|FRACTION",
        help="the session's swap limit: bytes ('6GiB') or a fraction of the unconstrained"
        " peak (0.6 = 60%%; numbers up to 1 are fractions)",
    )
    parser.add_argument(
        "--backend",
        choices=("sim", "cuda"),
        default="sim",
        help="the daemon to start when no --socket-dir is given (default sim)",
    )
    parser.add_argument(
        "--compute-scale", type=float, default=1.0, help="multiply op times (default 1)"
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=DEFAULT_ITERATIONS,
        metavar="N",
        help=f"iterations in all, the {LEARNING_ITERATIONS} learning ones and the switch to the"
        f" plan included (default {DEFAULT_ITERATIONS}, at least {MIN_ITERATIONS})",
    )
    parser.add_argument(
        "--copy-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="throttle swap copies to this bandwidth, GB/s (sim; default: memmove speed)",
    )
    parser.add_argument(
        "--shape",
        default=None,
        help="of a trace of several iteration shapes, the one to replay (default: all of them"
        " in one session, --iterations each, in a random order)",
    )
    parser.add_argument(
        "--recognise-shapes",
        action="store_true",
        help="of a trace of several iteration shapes: the steps name no shape, and the session"
        " tells each iteration's from its first allocation (attach(recognise_shapes=True);"
        " paged, with --page)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the random order of the shapes of a trace of several (default 0)",
    )
    parser.add_argument(
        "--page",
        default=None,
        metavar="BYTES",
        help="virtual residency: blocks keep their addresses and pages of this size (e.g."
        " 64KiB, 2MiB; a power of two dividing the daemon's 2 MiB chunks, the chunk itself on"
        " cuda) move beneath them;"
        " the limit counts mapped pages (default: a contiguous lease)",
    )
    parser.add_argument(
        "--device-min",
        default=None,
        metavar="SIZE",
        help="with --page: an elastic lease with this floor, its ceiling the lease the replay"
        " would ask for (the peak and a quarter): the daemon lends and takes back chunks above"
        " the floor as other jobs need them (default: a fixed lease)",
    )
    parser.add_argument(
        "--device-lease",
        default=None,
        metavar="SIZE",
        help="a fixed device lease of this size instead of the peak and a quarter",
    )
    parser.add_argument(
        "--plan-timeout",
        type=float,
        default=DEFAULT_PLAN_TIMEOUT_S,
        metavar="S",
        help="seconds to wait for the plan after the learning iterations"
        f" (default {DEFAULT_PLAN_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--socket-dir",
        dest="replay_socket_dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="use the daemon of DIR (default: start a private one for the run)",
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the run as a Chrome trace (Perfetto, chrome://tracing): when each op, copy"
        " and wait of the training thread ran, on which stream, beside the simulator's step"
        " for the daemon's plan at each steady iteration",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from tidalplan.autoswap import load as load_curve
    from tidalplan.autoswap import op_bound

    socket_dir = args.replay_socket_dir or getattr(args, "socket_dir", None)
    if args.shape is None:
        try:
            shapes = shapes_of(args.trace)
        except InputError as e:
            refuse(e)
            return 2
        if len(shapes) > 1:
            from tidaloffline.replay import shapes as several

            return several.run(args, list(shapes), socket_dir)
    try:
        if args.recognise_shapes:
            raise InputError(
                "--recognise-shapes is for a trace of several iteration shapes, replayed"
                f" together: {args.trace}"
                + (f" is replayed for shape {args.shape!r} alone" if args.shape else " has one")
            )
        check_options(args)
        it = load(args.trace, "replay", args.shape)
        peak = int(load_curve(it).max(initial=0))
        limit = parse_limit(args.limit, peak)
        bound = op_bound(it)
        if limit < bound:
            raise InputError(
                f"--limit {args.limit} ({format_size(limit)}) is below {format_size(bound)}, the"
                " bytes one op of the iteration accesses at once: no plan fits it"
            )
        check_backend(args, socket_dir)
    except (InputError, ReplayError) as e:
        refuse(e)
        return 2
    report = Report(
        trace=str(args.trace),
        backend=args.backend,
        daemon=str(socket_dir) if socket_dir is not None else "started",
        limit_bytes=limit,
        peak_bytes=peak,
        op_bound_bytes=bound,
        compute_scale=args.compute_scale,
        copy_gbps=args.copy_gbps,
        page_bytes=args.page or 0,
    )
    say = say_from(time.monotonic())
    try:
        with contextlib.ExitStack() as stack:
            directory = socket_dir
            if directory is None:
                directory = stack.enter_context(private_daemon(args.backend, peak, say))
            _replay(args, it, report, Path(directory), say)
    except ReplayError as e:
        refuse(e)
        return e.status
    if args.json:
        print(json.dumps(report.as_json()))
    else:
        render(report, Console())  # the tables fit its width, or fold
    if report.outcome != "compared":
        refuse(report.outcome)
        return 2
    checks = report.checks()
    return 1 if checks["mismatches"] or checks["not_resident"] else 0


def _replay(
    args: argparse.Namespace,
    it: Iteration,
    report: Report,
    directory: Path,
    say: Callable[[str], None],
) -> None:
    from tidalclient.errors import LeaseExceeded, SessionClosed

    session, report.limit_bytes = open_session(
        args, directory, report.limit_bytes, report.peak_bytes, say
    )
    with session:
        report.backend = "sim" if session.cuda is None else "cuda"
        compute = compute_of(session)
        replayer = Replayer(session, it, compute, args.compute_scale)
        report.unresolved_accesses = replayer.script.unresolved
        timeline = _timeline(session, compute, replayer) if args.timeline is not None else None
        try:
            _iterate(args, session, replayer, report, say)
        except LeaseExceeded as e:
            n = len(replayer.records)
            if not session.plans_received:
                raise ReplayError(
                    f"iteration {n} does not fit under the limit of"
                    f" {format_size(report.limit_bytes)} while learning: {e}"
                ) from None
            raise ReplayError(
                f"iteration {n} failed under plan {session.plan.plan_id if session.plan else '?'}:"
                f" {e}",
                status=1,
            ) from None
        except SessionClosed as e:
            raise ReplayError(f"the daemon ended the session: {e}") from None
        finally:
            report.missing_accesses = replayer.missing
        swap = session.executor.stats().swap
        report.peak_resident_bytes = swap.peak_resident_bytes if swap is not None else 0
        report.plan, report.predicted = plan_of(session)
    if timeline is not None:  # after the session: every copy has run
        report.timeline = _write_timeline(args, it, session, replayer, timeline, report)
        say(f"timeline written to {args.timeline}")


def _timeline(session: Session, compute: Compute, replayer: Replayer) -> Timeline:
    """A timeline the run's copies, ops, waits and iterations go on."""
    from tidalclient.timeline import Timeline

    timeline = Timeline()
    if session.cuda is not None:  # the GPU times its work: one clock for its events
        timeline.clock = session.compute.clock()
    assert session.residency is not None  # a replay's session always has a swap limit
    session.residency.timeline = timeline
    compute.timeline = timeline
    replayer.timeline = timeline
    return timeline


def _write_timeline(
    args: argparse.Namespace,
    it: Iteration,
    session: Session,
    replayer: Replayer,
    timeline: Timeline,
    report: Report,
) -> dict[str, Any]:
    """Write the run and, at each steady iteration's start, the simulator's step for the plan
    that ran; what the steady iterations show (means), for the report."""
    from tidalclient.timeline import COMPUTE_TRACK, HOST_TRACK, WAIT

    from tidaloffline.timeline import steps

    timeline.settle()
    origin = replayer.spans[0][0] if replayer.spans else 0
    events = timeline.chrome(1, f"measured ({report.backend})", origin)
    steady = [
        span for r, span in zip(report.records, replayer.spans, strict=True) if r.phase == "steady"
    ]
    about: dict[str, Any] = {"path": str(args.timeline)}
    if steady:
        busy = [timeline.busy_ns(COMPUTE_TRACK, a, b) for a, b in steady]
        about["compute_busy_ns"] = sum(busy) / len(busy)
        about["compute_idle_ns"] = (
            sum(b - a for a, b in steady) / len(steady) - about["compute_busy_ns"]
        )
        waits = [timeline.busy_ns(HOST_TRACK, a, b, prefix=WAIT) for a, b in steady]
        about["host_wait_ns"] = sum(waits) / len(waits)
    simulated, note = _simulated(it, session, replayer, args.compute_scale)
    if simulated is not None and steady:
        gbps = float(report.predicted["copy_gbps"]) if report.predicted else 0.0
        events += steps(
            simulated.iteration,
            simulated.schedule,
            simulated.result,
            "simulated (the daemon's plan)",
            2,
            gbps,
            gbps,
            args.compute_scale,
            at_ns=[a - origin for a, _ in steady],
        )
        scale = args.compute_scale
        sim_busy = sum(round(op.duration_ns * scale) for op in simulated.iteration.ops)
        about["simulated_compute_busy_ns"] = sim_busy
        about["simulated_compute_idle_ns"] = simulated.result.iteration_ns - sim_busy
    about["note"] = note
    document = {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "trace": str(args.trace),
            "limit_bytes": report.limit_bytes,
            "compute_scale": args.compute_scale,
            "plan": report.plan,
            "simulated": note,
        },
    }
    try:
        args.timeline.write_text(json.dumps(document, separators=(",", ":")), encoding="utf-8")
    except OSError as e:
        raise ReplayError(f"cannot write the timeline to {args.timeline}: {e}") from None
    return about


def _simulated(
    it: Iteration, session: Session, replayer: Replayer, compute_scale: float
) -> tuple[Simulated | None, str]:
    """The plan that ran, simulated on the replayed iteration (None, and why, when there is
    none to lay beside the run)."""
    from tidalcore.pages import MAX_WASTE, owns_pages
    from tidalplan.wire import simulated

    plan = session.plan
    if plan is None or plan.update is None:
        return None, "no plan ran: the run alone"
    page = plan.paging.page if plan.paging is not None else 0
    persistent_at = [
        (h.block.offset, bool(page) and owns_pages(int(h.block.size), page, MAX_WASTE))
        for h in replayer.persistent
    ]
    # The daemon knows the persistent blocks by the session's ids, the trace by its own.
    trace_id = {
        int(h.block.id): int(pid)
        for h, (pid, _) in zip(replayer.persistent, it.persistent, strict=True)
    }
    update = type(plan.update)()
    update.CopyFrom(plan.update)
    for k, persistent in enumerate(update.swap_persistent):
        if persistent:
            update.swap_blocks[k] = trace_id.get(update.swap_blocks[k], -1)
    try:
        done = simulated(it, update, persistent_at, compute_scale)
    except ValueError as e:
        return None, f"plan {plan.plan_id} could not be simulated on the trace: {e}"
    if not done.result.feasible:
        return None, f"plan {plan.plan_id} does not run on the trace's iteration"
    return done, f"plan {plan.plan_id} simulated at each steady iteration's start"


def _iterate(
    args: argparse.Namespace,
    session: Session,
    replayer: Replayer,
    report: Report,
    say: Callable[[str], None],
) -> None:
    """The rule: learn for LEARNING_ITERATIONS iterations; then, until the plan has arrived,
    wait for it (at most --plan-timeout, and not at all once the daemon has said it cannot
    make one: the run ends with its reason); run the rest of the N iterations (the first of them
    under the plan is the switch). The session switches once the plan's arena fits under the
    limit, which may take iterations: while none has been steady at the N-th, up to
    EXTRA_ITERATIONS more run."""
    replayer.setup()
    n = 0
    while n < args.iterations or (
        not report.steady() and n < args.iterations + EXTRA_ITERATIONS and not replayer.fell_back
    ):
        if n == LEARNING_ITERATIONS and not session.plans_received:
            say(f"waiting up to {args.plan_timeout:g} s for the daemon's plan")
            deadline = time.monotonic() + args.plan_timeout
            while (
                not session.plans_received
                and session.plan_unavailable is None
                and time.monotonic() < deadline
            ):
                time.sleep(0.02)
            if not session.plans_received and (told := session.plan_unavailable) is not None:
                report.records = replayer.records
                report.plan_unavailable = asdict(told)
                report.outcome = told.line()  # no plan follows: nothing to wait for
                return
            if not session.plans_received:
                report.records = replayer.records
                report.outcome = (
                    f"no plan arrived within {args.plan_timeout:g} s after"
                    f" {LEARNING_ITERATIONS} iterations (a limit too low for any plan, or a"
                    " daemon that plans later or not at all)"
                )
                return
        r = replayer.iteration()
        report.records = replayer.records
        n += 1
        say(
            f"iteration {r.index} ({r.phase}): {show_ms(r.step_ns)}, out"
            f" {show_size(r.planned_out_bytes)} planned"
            f" + {show_size(r.on_demand_out_bytes)} on demand,"
            f" in {show_size(r.planned_in_bytes)} + {show_size(r.on_demand_in_bytes)}"
        )
    if not report.steady():
        report.outcome = (
            "a plan arrived but no steady iteration ran under it"
            if session.plans_received
            else "no plan arrived"
        )
