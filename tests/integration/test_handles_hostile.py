"""A real daemon's handles socket under a hostile local user: slow and silent connections never
delay real attaches, and a client trusts only a daemon of a uid it accepts."""

from __future__ import annotations

import json
import os
import pwd
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import tidalpool
from tidalclient.errors import AttachError
from tidalclient.handles import request_lease
from tidalclient.local import LocalDaemon
from tidalclient.status import fetch
from tidalcore import framing
from tidalcore.v1 import handles_pb2


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def handles_of(daemon: LocalDaemon) -> Path:
    """The daemon's handles socket, once it is there: the daemon answers health checks on
    tidalpool.sock a moment before it binds handles.sock."""
    path = daemon.socket_dir / "handles.sock"
    wait_for(path.exists, f"{path} to exist")
    return path


class Hostile:
    """Holds `count` connections open to a handles socket from one thread: half send a 4-byte
    length prefix, then one byte every `drip_s`; half stay silent. One the daemon closes is
    opened again at once, as an attacker would."""

    def __init__(self, path: Path, count: int = 100, drip_s: float = 0.5) -> None:
        self.path, self.count, self.drip_s = path, count, drip_s
        self.connects = 0  # connections opened, reopened ones included
        self.turned_away = 0  # connects refused at once: the daemon's listen backlog was full
        self.closed_by_daemon = 0
        self._selector = selectors.DefaultSelector()
        self._open: dict[socket.socket, bool] = {}  # socket -> drips
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile", daemon=True)

    @property
    def open_now(self) -> int:
        return len(self._open)

    def __enter__(self) -> Hostile:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for sock in list(self._open):
            sock.close()
        self._selector.close()

    def _connect(self, drips: bool) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        if sock.connect_ex(str(self.path)) != 0:  # backlog full (EAGAIN): try again later
            sock.close()
            self.turned_away += 1
            return
        if drips:
            sock.send((1000).to_bytes(4, "little"))
        self._open[sock] = drips
        self._selector.register(sock, selectors.EVENT_READ)
        self.connects += 1

    def _forget(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._open[sock]
        sock.close()
        self.closed_by_daemon += 1

    def _run(self) -> None:
        next_drip = time.monotonic()
        while not self._stop.is_set():
            drips = sum(self._open.values())
            for _ in range(self.count - len(self._open)):
                self._connect(drips=drips < self.count // 2)
                drips = sum(self._open.values())
            for key, _ in self._selector.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    sock.recv(65536)  # a reply or the end: the daemon let it go
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self._forget(sock)
            if time.monotonic() >= next_drip:
                next_drip = time.monotonic() + self.drip_s
                for sock, drip in list(self._open.items()):
                    if drip:
                        try:
                            sock.send(b"\x08")
                        except BlockingIOError:
                            pass
                        except OSError:
                            self._forget(sock)


# A job's process, apart from the attacker's: it attaches ten times and prints how long each took.
ATTACHES = """
import json, sys, time
import tidalpool
times = []
for i in range(10):
    started = time.monotonic()
    with tidalpool.attach(sys.argv[1], "4MiB", "4MiB", job_name=f"real-{i}"):
        times.append(time.monotonic() - started)
print(json.dumps(times))
"""


def test_attaches_are_fast_while_a_hundred_hostile_connections_are_open(
    daemon: LocalDaemon,
) -> None:
    with Hostile(handles_of(daemon)) as hostile:
        wait_for(
            lambda: hostile.open_now == 100 or hostile.turned_away > 0,
            "100 hostile connections open, or as many as the daemon lets wait",
        )
        job = subprocess.run(
            [sys.executable, "-c", ATTACHES, str(daemon.socket_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert job.returncode == 0, job.stderr
        times = json.loads(job.stdout)
        # The daemon lets them go (deadline, or room for a waiting peer); they come back.
        wait_for(lambda: hostile.closed_by_daemon >= 100, "100 hostile connections dropped")
    p50 = statistics.median(times)
    p99 = statistics.quantiles(times, n=100, method="inclusive")[98]
    print(f"attach under 100 hostile connections: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    assert max(times) < 1.5, f"attach times (s): {[round(t, 3) for t in times]}"


def test_a_connection_silent_past_the_deadline_is_told_and_dropped(daemon: LocalDaemon) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(handles_of(daemon)))
        reply, fds = framing.receive(sock, handles_pb2.HandlesResponse)
        assert sock.recv(1) == b""
    assert (reply.error_code, reply.error_message, fds) == (
        "RESOURCE_EXHAUSTED",
        "no whole request within 2 s",
        [],
    )
    assert "handles.dropped" in daemon.log_path.read_text()


# -- the client checks who serves it ----------------------------------------------------------
def test_the_client_refuses_a_daemon_of_a_uid_it_does_not_accept(
    daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TIDALPOOL_DAEMON_USERS", raising=False)
    path = handles_of(daemon)
    uid, stranger = os.getuid(), os.getuid() + 12345
    name = pwd.getpwuid(uid).pw_name
    with pytest.raises(AttachError) as e:
        request_lease(path, 0, 0, "x", daemon_users=str(stranger))
    assert str(e.value).startswith(
        f"tidalpoold at {path} runs as uid {uid} ({name}), a user this client does not accept"
        f" (accepted: uid {stranger}); to trust another user, list it in daemon_users= or"
        " TIDALPOOL_DAEMON_USERS"
    )
    # It sent nothing: the daemon saw the connection end before the first byte.
    wait_for(
        lambda: "closed after 0 bytes of its request" in daemon.log_path.read_text(),
        "the daemon to see an empty connection",
    )
    monkeypatch.setenv("TIDALPOOL_DAEMON_USERS", str(stranger))
    with pytest.raises(AttachError, match=rf"accepted: uid {stranger}\)"):
        tidalpool.attach(daemon.socket_dir)
    # daemon_users replaces the variable; a name works as well as a uid.
    request_lease(path, 0, 0, "by-name", daemon_users=f"{stranger},{name}").close()


def test_the_client_accepts_a_daemon_of_its_own_uid_by_default(
    daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TIDALPOOL_DAEMON_USERS", raising=False)
    grant = request_lease(handles_of(daemon), 0, 0, "default")
    grant.close()
    assert grant.response.error_code == ""
    assert len(grant.device_fds) == 32  # the default lease, 64 MiB of 2 MiB chunks


def exchange(
    daemon: LocalDaemon, request: handles_pb2.HandlesRequest
) -> handles_pb2.HandlesResponse:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(handles_of(daemon)))
        framing.send(sock, request)
        response, fds = framing.receive(sock, handles_pb2.HandlesResponse)
        for fd in fds:
            os.close(fd)
        return response


def test_a_lease_given_back_ends_at_once_and_no_version_is_taken_for_another(
    daemon: LocalDaemon,
) -> None:
    """Version 3's give-back ends the pending session of its token; a give-back of version 2
    (an older daemon would read it as a lease request) and a lease request of version 3 are
    refused, naming the version, and lease nothing."""
    grant = request_lease(handles_of(daemon), 0, 0, "given back")
    grant.close()
    token = grant.response.token
    for version, fields in [(2, {"give_back_token": token}), (3, {"job_name": "lease"})]:
        refused = exchange(daemon, handles_pb2.HandlesRequest(version=version, **fields))
        assert refused.error_code == "INVALID_ARGUMENT" and refused.fd_count == 0
        assert f"handles protocol version {version} is not supported" in refused.error_message
    assert [s.session_id for s in fetch(daemon.socket_dir)[1].sessions] == [
        grant.response.session_id
    ]
    given = exchange(daemon, handles_pb2.HandlesRequest(version=3, give_back_token=token))
    assert (given.error_code, given.session_id) == ("", grant.response.session_id)
    assert not fetch(daemon.socket_dir)[1].sessions
    again = exchange(daemon, handles_pb2.HandlesRequest(version=3, give_back_token=token))
    assert again.error_code == "NOT_FOUND"
