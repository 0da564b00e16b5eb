"""A daemon under a service manager: READY=1 once both sockets accept connections, STOPPING=1
on SIGTERM, each with a STATUS line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidalpool.local import is_serving


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: keep the directory short.
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as directory:
        yield Path(directory)


def accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def test_ready_after_the_sockets_listen_and_stopping_on_sigterm(short_dir: Path) -> None:
    sockets = short_dir / "sockets"
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(short_dir / "notify.sock"))
    manager.settimeout(30)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDALPOOLD_")}
    env["NOTIFY_SOCKET"] = str(short_dir / "notify.sock")
    # The daemon's log goes to a file, shown when an assertion fails.
    log = short_dir / "tidalpoold.log"
    with manager, open(log, "wb") as out:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "tidalpoold", "serve", "--socket-dir", str(sockets)),
                *("--device-pool", "64MiB", "--host-pool", "64MiB", "--chunk-size", "2MiB"),
                *("--default-device-lease", "8MiB", "--default-host-lease", "8MiB"),
                *("--metrics-address", "", "--plan-cache-dir", str(short_dir / "plans")),
                *("--gpu", "0"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
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
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDALPOOLD_")}
    env["NOTIFY_SOCKET"] = str(short_dir / "notify.sock")
    blocker = short_dir / "not-a-dir"
    blocker.write_text("")
    with manager:
        out = subprocess.run(
            [
                *(sys.executable, "-m", "tidalpoold", "serve", "--socket-dir", str(blocker)),
                *("--device-pool", "64MiB", "--host-pool", "64MiB", "--chunk-size", "2MiB"),
                *("--default-device-lease", "8MiB", "--default-host-lease", "8MiB"),
                *("--metrics-address", "", "--plan-cache-dir", str(short_dir / "plans")),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        status = manager.recv(4096).decode()
    assert out.returncode == 1, out.stderr
    assert status.startswith("STATUS=cannot start: "), status
    assert str(blocker) in status
