"""A daemon under a service manager: READY=1 once both sockets accept connections, STOPPING=1
on SIGTERM, each with a STATUS line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tidalclient.local import LocalDaemon, is_serving

from ..conftest import StartDaemon


def accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def serve(socket_dir: Path, plans: Path) -> list[str]:
    """A small sim daemon's command line."""
    return [
        *(sys.executable, "-m", "tidalpoold", "serve", "--socket-dir", str(socket_dir)),
        *("--device-pool", "64MiB", "--host-pool", "64MiB", "--chunk-size", "2MiB"),
        *("--default-device-lease", "8MiB", "--default-host-lease", "8MiB"),
        *("--metrics-address", "", "--plan-cache-dir", str(plans)),
    ]


def manager_env(notify_socket: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDALPOOLD_")}
    env["NOTIFY_SOCKET"] = str(notify_socket)
    return env


def test_ready_after_the_sockets_listen_and_stopping_on_sigterm(short_dir: Path) -> None:
    sockets = short_dir / "sockets"
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(short_dir / "notify.sock"))
    manager.settimeout(30)
    # The daemon's log goes to a file, shown when an assertion fails.
    log = short_dir / "tidalpoold.log"
    with manager, open(log, "wb") as out:
        process = subprocess.Popen(
            [*serve(sockets, short_dir / "plans"), "--gpu", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=manager_env(short_dir / "notify.sock"),
        )
        try:
            ready = manager.recv(4096).decode()
            # At the moment READY=1 arrives, both sockets already take connections.
            listening = (accepts(sockets / "handles.sock"), is_serving(sockets))
            assert ready.splitlines() == ["READY=1", f"STATUS=serving GPU 0 (sim) on {sockets}"]
            assert listening == (True, True), log.read_text()

            process.send_signal(signal.SIGTERM)
            stopping = manager.recv(4096).decode()
            assert stopping.splitlines() == ["STOPPING=1", "STATUS=stopping: received SIGTERM"]
            assert process.wait(30) == 0, log.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert not (sockets / "tidalpool.sock").exists()


def test_a_daemon_that_cannot_start_says_why_in_its_status(short_dir: Path) -> None:
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(short_dir / "notify.sock"))
    manager.settimeout(30)
    blocker = short_dir / "not-a-dir"
    blocker.write_text("")
    with manager:
        out = subprocess.run(
            serve(blocker, short_dir / "plans"),
            capture_output=True,
            text=True,
            env=manager_env(short_dir / "notify.sock"),
            timeout=60,
        )
        status = manager.recv(4096).decode()
    assert out.returncode == 2, out.stderr  # a setting refused: usage, as every other one
    assert status.startswith("STATUS=cannot start: "), status
    assert str(blocker) in status


def test_a_second_daemon_on_the_same_sockets_says_why_it_refuses(
    short_dir: Path, start_daemon: StartDaemon
) -> None:
    first: LocalDaemon = start_daemon()
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(short_dir / "notify.sock"))
    manager.settimeout(30)
    with manager:
        out = subprocess.run(
            serve(first.socket_dir, short_dir / "plans"),
            capture_output=True,
            text=True,
            env=manager_env(short_dir / "notify.sock"),
            timeout=60,
        )
        status = manager.recv(4096).decode()
    assert out.returncode == 1, out.stderr
    refusal = f"another daemon (pid {first.process.pid}) serves {first.socket_dir}"
    assert refusal in out.stderr
    assert status == f"STATUS=cannot start: {refusal}: stop it, or use another --socket-dir"
    assert is_serving(first.socket_dir)


def test_a_manager_that_is_gone_does_not_stop_the_daemon(short_dir: Path) -> None:
    sockets = short_dir / "sockets"
    log = short_dir / "tidalpoold.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            serve(sockets, short_dir / "plans"),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=manager_env(short_dir / "nobody-listens.sock"),
        )
    try:
        deadline = time.monotonic() + 30
        while not is_serving(sockets, timeout=0.5):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    failures = [line for line in log.read_text().splitlines() if "notify.failed" in line]
    assert len(failures) == 2, log.read_text()
    assert "why=READY=1: [Errno 2] No such file or directory" in failures[0]
    assert "why=STOPPING=1: [Errno 2] No such file or directory" in failures[1]
