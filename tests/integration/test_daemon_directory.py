"""The socket directory: one daemon per directory, a directory no other uid can write into,
and an Admin socket only the daemon's uid (and root) may use."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tidalpool
from tidalclient import status
from tidalclient.local import LocalDaemon, is_serving

NOBODY = 65534


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def serve(socket_dir: Path) -> subprocess.Popen[str]:
    """`tidalpoold serve` on small pools, its output kept for the test to read."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tidalpoold",
            "serve",
            "--socket-dir",
            str(socket_dir),
            *("--device-pool", "64MiB", "--host-pool", "64MiB", "--chunk-size", "2MiB"),
            *("--default-device-lease", "8MiB", "--default-host-lease", "8MiB"),
            *("--metrics-address", "", "--plan-cache-dir", str(socket_dir / "plans")),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("TIDALPOOLD_")},
    )


def wait_for(condition: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stop(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    return out


def test_two_daemons_started_together_one_serves_the_other_says_why(socket_dir: Path) -> None:
    first, second = serve(socket_dir), serve(socket_dir)
    try:
        wait_for(lambda: first.poll() is not None or second.poll() is not None, "one to exit")
        loser, winner = (first, second) if first.poll() is not None else (second, first)
        out = loser.communicate(timeout=10)[0]
        assert loser.returncode == 1
        assert f"another daemon (pid {winner.pid}) serves {socket_dir}" in out
        assert "Traceback" not in out
        wait_for(lambda: is_serving(socket_dir, timeout=0.5), "the winner to serve")
        assert winner.poll() is None
        with tidalpool.attach(socket_dir, device_limit="2MiB") as s:  # every socket works
            assert s.malloc(1024).size == 1024
            assert len(status.fetch(socket_dir)[1].sessions) == 1
    finally:
        for p in (first, second):
            stop(p)


def test_a_daemon_killed_with_sigkill_is_followed_by_the_next_one(socket_dir: Path) -> None:
    killed = serve(socket_dir)
    try:
        wait_for(lambda: is_serving(socket_dir, timeout=0.5), "the first daemon")
        killed.kill()  # leaves its sockets and its lock file behind; the kernel drops the lock
        killed.wait(timeout=10)
    finally:
        stop(killed)
    assert (socket_dir / "tidalpoold.lock").exists() and (socket_dir / "admin.sock").exists()
    with LocalDaemon.start(
        socket_dir, device_pool="64MiB", host_pool="64MiB", default_lease="8MiB"
    ) as d:
        assert d.process.poll() is None
        assert (socket_dir / "tidalpoold.lock").read_text() == f"{d.process.pid}\n"
        assert status.fetch(socket_dir)[0].device.leased_bytes == 0


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")


@needs_root
def test_a_directory_another_uid_owns_is_refused(socket_dir: Path) -> None:
    os.chown(socket_dir, NOBODY, NOBODY)
    p = serve(socket_dir)
    assert p.wait(timeout=30) == 1
    out = stop(p)
    assert f"socket directory {socket_dir} belongs to uid {NOBODY}" in out
    assert not (socket_dir / "handles.sock").exists()


def test_a_directory_others_can_write_is_refused_unless_sticky(socket_dir: Path) -> None:
    os.chmod(socket_dir, 0o777)
    p = serve(socket_dir)
    assert p.wait(timeout=30) == 1
    out = stop(p)
    assert "is writable by others without the sticky bit" in out
    assert not (socket_dir / "handles.sock").exists()
    os.chmod(socket_dir, 0o1777)  # /tmp's mode: others may not replace the daemon's files
    p = serve(socket_dir)
    try:
        wait_for(lambda: is_serving(socket_dir, timeout=0.5), "the daemon in a sticky directory")
    finally:
        stop(p)


def test_a_missing_directory_is_made_for_the_daemon_alone(socket_dir: Path) -> None:
    made = socket_dir / "gpu0"
    with LocalDaemon.start(made, device_pool="64MiB", host_pool="64MiB", default_lease="8MiB"):
        assert os.stat(made).st_mode & 0o7777 == 0o755
        assert os.stat(made / "admin.sock").st_mode & 0o777 == 0o600
        assert os.stat(made / "tidalpool.sock").st_mode & 0o777 == 0o660


def connect_as(uid: int, paths: list[Path]) -> list[int]:
    """Connect to each Unix socket from a forked child running as `uid` (and its group alone):
    0 where the kernel let it connect, else the errno."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, only the connects and an exit
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            results = []
            for path in paths:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    try:
                        sock.connect(str(path))
                        results.append(0)
                    except OSError as e:
                        results.append(e.errno or -1)
            os.write(write, " ".join(map(str, results)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    assert os.waitpid(pid, 0)[1] == 0
    return [int(x) for x in text.split()]


@needs_root
def test_a_job_of_another_uid_reaches_the_pool_but_not_admin(socket_dir: Path) -> None:
    """Sockets open to every uid (--socket-mode 0666, as some sites run it) still keep Admin,
    which lists and evicts every session, on admin.sock (0600): the kernel refuses another uid
    before the daemon reads a byte."""
    os.chmod(socket_dir, 0o755)
    with LocalDaemon.start(
        socket_dir,
        device_pool="64MiB",
        host_pool="64MiB",
        default_lease="8MiB",
        extra=("--socket-mode", "0666"),
    ):
        paths = [socket_dir / name for name in ("tidalpool.sock", "handles.sock", "admin.sock")]
        assert connect_as(NOBODY, paths) == [0, 0, errno.EACCES]
        assert connect_as(os.getuid(), paths) == [0, 0, 0]


@needs_root
def test_a_client_sends_its_token_only_to_a_grpc_socket_of_the_daemons_uid(
    socket_dir: Path,
) -> None:
    with LocalDaemon.start(
        socket_dir, device_pool="64MiB", host_pool="64MiB", default_lease="8MiB", chunk_size="2MiB"
    ):
        os.chown(socket_dir / "tidalpool.sock", NOBODY, NOBODY)  # as if another uid made it
        with pytest.raises(tidalpool.AttachError, match="belongs to uid 65534, but the daemon"):
            tidalpool.attach(socket_dir, device_limit="2MiB")
        os.chown(socket_dir / "tidalpool.sock", 0, 0)
        with tidalpool.attach(socket_dir, device_limit="2MiB") as s:
            assert s.malloc(1024).size == 1024
