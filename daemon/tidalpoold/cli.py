"""`tidalpoold`: the daemon's command line.

Every error it reports is one line on stderr, after "tidalpoold:", and a non-zero exit status:
2 for what the command line or the settings got wrong (argparse's errors included, and what
start-up finds wrong with a setting: a socket or plan-cache directory that is a file, pools of
more chunks than open files allow), 1 for a daemon that cannot start for another reason
(another daemon on the directory, a directory others could write).
`--debug` (or TIDALPOOL_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType

from tidalcore.cli import DEBUG_ENV, Parser, debug_from_env
from tidalcore.signals import Flag

from tidalpoold import __version__, log
from tidalpoold.directory import SettingRefused
from tidalpoold.notify import Notifier
from tidalpoold.server import build_daemon
from tidalpoold.settings import (
    SettingsError,
    add_arguments,
    setting_options,
    settings_from_args,
)


def one_line(error: BaseException) -> str:
    """The error's message on one line; its type where the message is empty."""
    return " ".join(str(error).split()) or type(error).__name__


def _parser() -> tuple[Parser, Parser]:
    parser = Parser(prog="tidalpoold", description="The per-GPU tidalpool daemon.")
    parser.add_argument("--version", action="version", version=f"tidalpoold {__version__}")
    debug_help = f"show the traceback of an error (also {DEBUG_ENV}=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="own the GPU's pools and serve sessions")
    add_arguments(serve)
    # Also after the command, where a user adds it to a command line that failed; listed by
    # tidalpoold --help only.
    serve.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    return parser, serve


def joined_values(argv: list[str]) -> list[str]:
    """`argv` with a setting's value that starts with "-" joined to its option ("--device-pool
    -1GiB" as "--device-pool=-1GiB"): argparse would take "-1GiB" for an option and say only
    "expected one argument", where the setting's own check says what is wrong with it."""
    options = setting_options()
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in options and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    parser, serve = _parser()
    args, extra = parser.parse_known_args(joined_values(sys.argv[1:] if argv is None else argv))
    if extra:  # named by the command they were given to
        serve.error(f"unrecognized arguments: {' '.join(extra)}")
    debug = args.debug or debug_from_env(os.environ)
    try:
        return _serve(args, serve, debug)
    except KeyboardInterrupt:  # before the signal handlers are in place
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"tidalpoold: {one_line(e)} (--debug shows where)", file=sys.stderr)
        return 1


def _serve(args: argparse.Namespace, serve: Parser, debug: bool) -> int:
    """Run the daemon until SIGTERM or SIGINT; 1, saying why in one line, if it cannot start."""
    try:
        settings = settings_from_args(args, os.environ)
    except SettingsError as e:
        serve.exit(2, f"tidalpoold: {e}\n")
    log.configure(settings.log_format, settings.log_level)
    notifier = Notifier(os.environ.get("NOTIFY_SOCKET"))  # set by systemd for Type=notify
    # Handlers first: a signal during start-up must stop the daemon once it is built,
    # not kill it half-way with KeyboardInterrupt. The handler takes no lock (`Flag`).
    stop_reason: list[str] = []
    stop = Flag()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop_reason.append(f"received {signal.Signals(signum).name}")
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    stop.wake_on_signals()  # a signal taken by one of gRPC's threads wakes the wait too
    try:
        daemon = build_daemon(settings)
    except (OSError, ValueError, RuntimeError, NotImplementedError) as e:
        why = one_line(e)
        notifier.send(f"STATUS=cannot start: {why}")
        if debug:
            raise
        if settings.log_format == "json":  # for a log collector; on text logs, the line below
            logging.getLogger("tidalpoold").error("daemon.start_failed", extra={"why": why})
        print(f"tidalpoold: cannot start: {why}", file=sys.stderr)
        return 1
    except SystemExit as e:  # a refusal that names its cause (another daemon, too few fds)
        notifier.send(f"STATUS=cannot start: {e}")
        if debug or not isinstance(e.code, str):
            raise
        print(f"tidalpoold: {one_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, SettingRefused) else 1
    notifier.send(  # the pools are allocated and both sockets listen
        "READY=1",
        f"STATUS=serving GPU {settings.gpu} ({settings.backend}) on {settings.socket_dir}",
    )
    stop.wait()
    notifier.send("STOPPING=1", f"STATUS=stopping: {stop_reason[0]}")
    daemon.shutdown(stop_reason[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
