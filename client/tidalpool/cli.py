"""`tidalpool`: the command line: demo, status, top and health (the client's views of a
daemon) and plan, simulate and replay (the offline tools)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

import optuna
from rich.console import Console
from tidalclient import status as status_view
from tidalclient import top as top_view
from tidalclient.demo.run import run as run_demo
from tidalclient.health import check
from tidalclient.session import socket_dir_from_env
from tidalcore import __version__
from tidaloffline import plan_command, replay, simulate_command


def main(argv: list[str] | None = None) -> int:
    optuna.logging.set_verbosity(logging.WARNING)  # the planner's tuning: say only what matters
    parser = argparse.ArgumentParser(
        prog="tidalpool", description="tidalpool: GPU memory for training jobs."
    )
    parser.add_argument("--version", action="version", version=f"tidalpool {__version__}")
    parser.add_argument(
        "--socket-dir",
        type=Path,
        default=None,
        help="the daemon's socket directory (default: $TIDALPOOL_SOCKET_DIR or /run/tidalpool)",
    )
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
        help="swap to stay under this fraction of the network's peak live bytes (e.g. 0.5)",
    )
    demo.add_argument(
        "--copy-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="throttle swap copies to this bandwidth in GB/s (default: as fast as memmove)",
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
    args = parser.parse_args(argv)
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
            parser.error("--iterations must be at least 1")
        if args.limit is not None and not 0 < args.limit <= 1:
            parser.error("--limit must be a fraction in (0, 1]")
        if args.copy_gbps is not None and args.copy_gbps <= 0:
            parser.error("--copy-gbps must be positive")
        ok = run_demo(
            socket_dir, args.iterations, console, args.limit, args.copy_gbps, backend=args.backend
        )
        return 0 if ok else 1

    if args.command == "top":
        if not (args.interval > 0 and math.isfinite(args.interval)):
            parser.error("--interval must be a positive number of seconds")
        if args.iterations is not None and args.iterations < 1:
            parser.error("--iterations must be at least 1")
        return top_view.run(
            socket_dir, console, Console(stderr=True), args.interval, args.iterations
        )

    if args.command == "health":
        if not (args.timeout > 0 and math.isfinite(args.timeout)):
            parser.error("--timeout must be a positive number of seconds")
        answer = check(socket_dir, args.service, args.timeout)
        print(
            answer.message if answer.serving else f"tidalpool: {answer.message}",
            file=sys.stdout if answer.serving else sys.stderr,
        )
        return 0 if answer.serving else 1

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


if __name__ == "__main__":
    sys.exit(main())
