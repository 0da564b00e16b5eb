"""`tidalpoold`: the daemon's command line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from types import FrameType

from tidalpoold import __version__, log
from tidalpoold.notify import Notifier
from tidalpoold.server import build_daemon
from tidalpoold.settings import SettingsError, add_arguments, settings_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidalpoold", description="The per-GPU tidalpool daemon.")
    parser.add_argument("--version", action="version", version=f"tidalpoold {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="own the GPU's pools and serve sessions")
    add_arguments(serve)
    args = parser.parse_args(argv)

    try:
        settings = settings_from_args(args, os.environ)
    except SettingsError as e:
        parser.exit(2, f"tidalpoold: {e}\n")
    log.configure(settings.log_format, settings.log_level)
    notifier = Notifier(os.environ.get("NOTIFY_SOCKET"))  # set by systemd for Type=notify
    # Handlers first: a signal during start-up must stop the daemon once it is built,
    # not kill it half-way with KeyboardInterrupt.
    stop_reason: list[str] = []
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop_reason.append(f"received {signal.Signals(signum).name}")
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        daemon = build_daemon(settings)
    except (OSError, ValueError, NotImplementedError) as e:
        logging.getLogger("tidalpoold").error("daemon.start_failed", extra={"why": str(e)})
        print(f"tidalpoold: cannot start: {e}", file=sys.stderr)
        notifier.send(f"STATUS=cannot start: {e}")
        return 1
    except SystemExit as e:  # a refusal that names its cause (another daemon, too few fds)
        notifier.send(f"STATUS=cannot start: {e}")
        raise
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
