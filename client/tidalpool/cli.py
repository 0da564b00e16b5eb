"""`tidalpool`: the command line: demo, status, top and health (the client's views of a
daemon) and plan, simulate and replay (the offline tools).

Every error it reports is one line on stderr and a non-zero exit status: 2 for a usage error
(argparse's own included: `tidalpool demo: error: ... (see tidalpool demo --help)`), 1 for a
command that failed. `--debug` (or TIDALPOOL_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path

import grpc
import optuna
from rich.console import Console
from tidalclient import status as status_view
from tidalclient import top as top_view
from tidalclient.demo.run import SIM_PAGE, limit_problem
from tidalclient.demo.run import run as run_demo
from tidalclient.errors import TidalpoolError
from tidalclient.health import check
from tidalclient.session import socket_dir_from_env
from tidalcore import __version__
from tidalcore.cli import DEBUG_ENV, Parser, debug_from_env
from tidalcore.units import parse_size
from tidaloffline import plan_command, replay, simulate_command

GLOBAL_OPTIONS = ("--socket-dir",)  # options of `tidalpool` itself, given before the command
# Failures whose message says all: no type name, no hint of a bug.
EXPECTED = (TidalpoolError, OSError, ValueError, RuntimeError, MemoryError, grpc.RpcError)


def one_line(error: BaseException) -> str:
    """What went wrong, on one line: the message (a gRPC error's code and details), its type
    where it has none."""
    if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call):
        text = f"{error.code().name}: {error.details() or ''}"
    else:
        text = str(error)
    return " ".join(text.split()) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    optuna.logging.set_verbosity(logging.WARNING)  # the planner's tuning: say only what matters
    parser, commands = _parser()
    args, extra = parser.parse_known_args(argv)
    command = commands[args.command]
    if extra:  # named by the command they were given to
        misplaced = [o for o in GLOBAL_OPTIONS if o in (x.split("=")[0] for x in extra)]
        hint = "".join(
            f"; {o} goes before the command: tidalpool {o} ... {args.command}" for o in misplaced
        )
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    debug = args.debug or debug_from_env(os.environ)
    try:
        status = _run(args, command)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stdout's reader went away (`| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        if debug:
            raise
        hint = "" if isinstance(e, EXPECTED) else f" ({type(e).__name__}; --debug shows where)"
        print(f"{command.prog}: {one_line(e)}{hint}", file=sys.stderr)
        return 1


def _parser() -> tuple[Parser, dict[str, Parser]]:
    """The parser of `tidalpool` and those of its commands, by name."""
    parser = Parser(prog="tidalpool", description="tidalpool: GPU memory for training jobs.")
    parser.add_argument("--version", action="version", version=f"tidalpool {__version__}")
    parser.add_argument(
        "--socket-dir",
        type=Path,
        default=None,
        help="the daemon's socket directory (default: $TIDALPOOL_SOCKET_DIR, else in a rank of"
        " torchrun or srun its GPU's, /run/tidalpool/gpu<N>, else /run/tidalpool; {gpu} in"
        " either is the GPU's index)",
    )
    debug_help = f"show the traceback of an error (also {DEBUG_ENV}=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train a small network in a session (starts a daemon if none runs) and compare its"
        " losses with the same training outside tidalpool",
    )
    demo.add_argument(
        "--backend",
        choices=("sim", "cuda"),
        default="sim",
        help="the daemon to start when none runs: sim (NumPy, host memory) or cuda (CuPy on"
        " GPU 0); a running daemon is used whatever its backend (default sim)",
    )
    demo.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="training iterations (default 20; 40 with --limit, whose swap plan takes longer)",
    )
    demo.add_argument(
        "--limit",
        type=float,
        default=None,
        metavar="FRACTION",
        help="swap to stay under this fraction of the network's peak live bytes (e.g. 0.5; at"
        " least the share its largest op needs at once: 0.49 in the 4 KiB pages of a sim session)",
    )
    demo.add_argument(
        "--copy-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="throttle swap copies to this bandwidth in GB/s (default: as fast as memmove);"
        " without --limit the session swaps only when its lease is full",
    )
    status = commands.add_parser(
        "status", help="pool usage and sessions of a running daemon (live: tidalpool top)"
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    top = commands.add_parser(
        "top", help="status, live: pools, sessions and swap traffic, redrawn until Ctrl-C"
    )
    top.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="time between refreshes (default 1)",
    )
    frames = top.add_mutually_exclusive_group()
    frames.add_argument(
        "--iterations",
        type=int,
        default=None,
        metavar="N",
        help="stop after N refreshes (default: until Ctrl-C or the daemon stops)",
    )
    frames.add_argument(
        "--once", action="store_const", const=1, dest="iterations", help="one refresh, then stop"
    )
    quota = commands.add_parser(
        "quota",
        help="change an elastic session's floor and ceiling (the pool is shared again at once)",
    )
    quota.add_argument("session", help="the session's id (tidalpool status lists them)")
    quota.add_argument("--min", dest="device_min", metavar="SIZE", help="new floor, e.g. 1GiB")
    quota.add_argument("--max", dest="device_max", metavar="SIZE", help="new ceiling, e.g. 8GiB")
    health = commands.add_parser(
        "health",
        help="exit 0 if the daemon serves, 1 if not (the gRPC health check, for probes)",
    )
    health.add_argument(
        "--service",
        default="",
        help='the gRPC service to ask about (default "": the daemon as a whole)',
    )
    health.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long to wait for the answer (default 5)",
    )
    plan_command.add_parser(commands)
    simulate_command.add_parser(commands)
    replay.add_parser(commands)
    for sub in commands.choices.values():  # also after the command, as users add it; listed
        # by tidalpool --help only
        sub.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser, dict(commands.choices)


def _run(args: argparse.Namespace, command: Parser) -> int:
    """Run the command; its exit status. Usage errors exit through `command.error`."""
    if args.command == "plan":
        return plan_command.run(args)
    if args.command == "simulate":
        return simulate_command.run(args)
    if args.command == "replay":
        return replay.run(args)
    socket_dir = socket_dir_from_env(args.socket_dir)
    console = Console()

    if args.command == "demo":
        if args.iterations is None:
            args.iterations = 20 if args.limit is None else 40
        if args.iterations < 1:
            command.error("--iterations must be at least 1")
        page = SIM_PAGE if args.backend == "sim" else None  # as run_demo pages under a limit
        if args.limit is not None and (problem := limit_problem(args.limit, page)) is not None:
            command.error(problem)
        if args.copy_gbps is not None and not (
            math.isfinite(args.copy_gbps) and args.copy_gbps > 0
        ):
            command.error("--copy-gbps must be a positive number of GB/s")
        ok = run_demo(
            socket_dir, args.iterations, console, args.limit, args.copy_gbps, backend=args.backend
        )
        return 0 if ok else 1

    if args.command == "top":
        if not (args.interval > 0 and math.isfinite(args.interval)):
            command.error("--interval must be a positive number of seconds")
        if args.iterations is not None and args.iterations < 1:
            command.error("--iterations must be at least 1")
        return top_view.run(
            socket_dir, console, Console(stderr=True), args.interval, args.iterations
        )

    if args.command == "health":
        if not (args.timeout > 0 and math.isfinite(args.timeout)):
            command.error("--timeout must be a positive number of seconds")
        answer = check(socket_dir, args.service, args.timeout)
        print(
            answer.message if answer.serving else f"tidalpool: {answer.message}",
            file=sys.stdout if answer.serving else sys.stderr,
        )
        return 0 if answer.serving else 1

    if args.command == "quota":
        return _quota(socket_dir, args, command)

    try:
        pool, sessions = status_view.fetch(socket_dir)
    except status_view.Unreachable as e:
        print(f"tidalpool: no daemon answers at {socket_dir}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(status_view.as_json(pool, sessions))
    else:
        status_view.render(pool, sessions, console)
    return 0


def _quota(socket_dir: Path, args: argparse.Namespace, command: Parser) -> int:
    """`tidalpool quota SESSION --min --max`: the session's new bounds, or why not."""
    if args.device_min is None and args.device_max is None:
        command.error("give --min, --max or both")
    try:
        floor = parse_size(args.device_min) if args.device_min is not None else 0
        ceiling = parse_size(args.device_max) if args.device_max is not None else 0
    except ValueError as e:
        command.error(str(e))
    if (args.device_min is not None and floor <= 0) or (
        args.device_max is not None and ceiling <= 0
    ):
        command.error("--min and --max must be positive sizes")
    try:
        s = status_view.set_quota(socket_dir, args.session, floor, ceiling)
    except status_view.Unreachable as e:
        print(f"tidalpool: no daemon answers at {socket_dir}: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print(f"tidalpool: quota refused ({e.code().name}): {e.details()}", file=sys.stderr)
        return 1
    print(f"{s.session_id}: device {status_view.lease_text(s)} (held of floor / quota / ceiling)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
