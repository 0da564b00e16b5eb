"""The handles socket's peers, one HandlesServer in this process on a sim registry: who is
judged before a byte is read, how a slow or silent peer is cut off without delaying others,
accept errors that never end the loop, and the client's check of the daemon's uid."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tidalclient.errors import AttachError
from tidalclient.handles import accepted_uids, request_lease
from tidalcore import framing
from tidalcore.units import Bytes
from tidalcore.v1 import handles_pb2
from tidalcore.wire import HANDLES_VERSION
from tidalpoold.backends import SimBackend
from tidalpoold.handles import HandlesServer
from tidalpoold.sessions import Registry
from tidalpoold.settings import Settings

C = 2 * 1024 * 1024  # one chunk
MakeServer = Callable[..., HandlesServer]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


@pytest.fixture
def registry() -> Iterator[Registry]:
    """Pools of 8 chunks each, leases of one chunk by default."""
    directory = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    settings = Settings(
        device_pool=Bytes(8 * C),
        host_pool=Bytes(8 * C),
        default_device_lease=Bytes(C),
        default_host_lease=Bytes(C),
        chunk_size=Bytes(C),
        socket_dir=directory,
        plan_cache_dir=directory,
        metrics_address="",
    )
    backend = SimBackend(8 * C, 8 * C, C)
    yield Registry(settings, backend)
    backend.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def make_server(registry: Registry) -> Iterator[MakeServer]:
    """HandlesServers on handles.sock of the registry's directory; `own_uid` pretends the
    server runs as another uid (this process then is a foreign peer). Closed at the end."""
    servers: list[HandlesServer] = []

    def make(
        own_uid: int | None = None, allowed_gids: tuple[int, ...] = (), **kwargs: Any
    ) -> HandlesServer:
        path = registry.settings.socket_dir / f"h{len(servers)}.sock"
        server = HandlesServer(path, registry, 0o600, allowed_gids, **kwargs)
        if own_uid is not None:
            server.own_uid = own_uid
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.close()


def connect(server: HandlesServer) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(str(server.path))
    return sock


def request() -> handles_pb2.HandlesRequest:
    return handles_pb2.HandlesRequest(version=HANDLES_VERSION, job_name="unit")


def reply_of(sock: socket.socket) -> handles_pb2.HandlesResponse:
    response, fds = framing.receive(sock, handles_pb2.HandlesResponse)
    assert fds == []
    return response


# -- judged before a byte is read ------------------------------------------------------------
def test_a_foreign_peer_is_refused_before_it_sends_anything(
    make_server: MakeServer, registry: Registry
) -> None:
    foreign = os.getuid() + 1
    server = make_server(own_uid=foreign, timeout_s=30.0)
    with connect(server) as sock:
        # Nothing sent yet: the refusal can only come from SO_PEERCRED, checked at accept.
        refusal = reply_of(sock)
        assert refusal.error_code == "PERMISSION_DENIED"
        assert refusal.error_message == (
            f"uid {os.getuid()} (pid {os.getpid()}) may not use this daemon: it runs as uid"
            f" {foreign} and admits no groups"
        )
        # The request a client sends meanwhile still goes out (no EPIPE, no reset); the server
        # reads it away and has shut its side: the next read is the end, not an error.
        framing.send(sock, request())
        assert sock.recv(1) == b""
    assert registry.sessions() == []


def test_a_foreign_peer_in_an_allowed_group_is_served(
    make_server: MakeServer, registry: Registry
) -> None:
    server = make_server(own_uid=os.getuid() + 1, allowed_gids=(os.getgid(),))
    grant = request_lease(server.path, 0, 0, "grouped")
    grant.close()
    assert grant.response.error_code == ""
    assert (len(grant.device_fds), len(grant.host_fds)) == (1, 1)
    assert [s.job_name for s in registry.sessions()] == ["grouped"]


# -- one deadline, no peer delays another -----------------------------------------------------
def test_a_dripping_peer_is_cut_off_at_the_one_deadline(make_server: MakeServer) -> None:
    """A byte every 0.1 s keeps every single read short: only a deadline for the whole
    request ends it."""
    server = make_server(timeout_s=0.5)
    with connect(server) as sock:
        sock.sendall((1000).to_bytes(4, "little"))
        sock.settimeout(0.1)
        reply = b""
        deadline = time.monotonic() + 20
        while not reply:
            assert time.monotonic() < deadline, "the dripping peer was never cut off"
            try:
                sock.send(b"\x08")
                reply = sock.recv(4096)
            except TimeoutError:
                continue
            except BrokenPipeError:
                reply = sock.recv(4096)
        response = handles_pb2.HandlesResponse.FromString(reply[4:])
    assert response.error_code == "RESOURCE_EXHAUSTED"
    assert response.error_message == "no whole request within 0.5 s"


def test_a_full_server_drops_its_oldest_silent_peer_for_a_waiting_one(
    make_server: MakeServer, records: Records
) -> None:
    server = make_server(timeout_s=60.0, max_connections=4)
    silent = [connect(server) for _ in range(4)]
    try:
        started = time.monotonic()
        grant = request_lease(server.path, 0, 0, "waits")  # 5th: the server is full
        grant.close()
        assert time.monotonic() - started < 30, "the waiting peer waited for a deadline"
        dropped = reply_of(silent[0])
        assert dropped.error_code == "RESOURCE_EXHAUSTED"
        assert "while the handles socket holds its 4 connections and another peer waits" in (
            dropped.error_message
        )
        (crowded,) = records.named("handles.crowded")  # one line, naming the first dropped
        assert (crowded.__dict__["pid"], crowded.__dict__["why"]) == (
            os.getpid(),
            dropped.error_message,
        )
    finally:
        for sock in silent:
            sock.close()


# Another process: holds one silent connection to the socket named by argv[1] until told.
HOLDER = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
print("connected", flush=True)
sys.stdin.read()
"""


def test_a_full_server_drops_from_the_process_holding_the_most_not_the_oldest(
    make_server: MakeServer, records: Records
) -> None:
    server = make_server(timeout_s=60.0, max_connections=4)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(server.path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    silent: list[socket.socket] = []
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "connected\n"
        silent = [connect(server) for _ in range(3)]  # full: the holder's is the oldest
        request_lease(server.path, 0, 0, "waits").close()
        assert reply_of(silent[0]).error_code == "RESOURCE_EXHAUSTED"
        dropped = [r.__dict__["pid"] for r in records.named("handles.dropped")]
        assert dropped == [os.getpid()], "a connection of the process holding one was dropped"
    finally:
        for sock in silent:
            sock.close()
        holder.communicate("", timeout=30)


@pytest.mark.parametrize(
    ("head", "body", "message"),
    [
        ((70000).to_bytes(4, "little"), b"", "request of 70000 bytes exceeds the limit of 65536"),
        ((2).to_bytes(4, "little"), b"\xff\xff", "malformed tidalpool.v1.HandlesRequest"),
    ],
)
def test_a_bad_request_is_answered_invalid_argument(
    make_server: MakeServer, head: bytes, body: bytes, message: str
) -> None:
    server = make_server()
    with connect(server) as sock:
        sock.sendall(head + body)
        reply = reply_of(sock)
    assert reply.error_code == "INVALID_ARGUMENT"
    assert reply.error_message.startswith(message)


def test_close_does_not_wait_for_held_connections(registry: Registry) -> None:
    path = registry.settings.socket_dir / "c.sock"
    server = HandlesServer(path, registry, 0o600, (), timeout_s=60.0, max_connections=8)
    server.start()
    held = [connect(server) for _ in range(12)]  # 8 held, 4 in the backlog
    held[0].sendall((100).to_bytes(4, "little") + b"\x08")
    try:
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 30, "close() waited for a connection's deadline"
        assert not path.exists()
        for sock in held[1:]:  # each dropped (held, or in the backlog), none left hanging
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""
    finally:
        for sock in held:
            sock.close()


# -- accept errors never end the loop ---------------------------------------------------------
class Records(logging.Handler):
    """The handles logger's records, for waiting on them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def named(self, event: str) -> list[logging.LogRecord]:
        return [r for r in self.records if r.getMessage() == event]


@pytest.fixture
def records() -> Iterator[Records]:
    logger = logging.getLogger("tidalpoold.handles")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_running_out_of_fds_pauses_accepting_and_it_resumes(
    make_server: MakeServer, records: Records
) -> None:
    server = make_server()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(20)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
        while True:
            try:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as e:
                assert e.errno == errno.EMFILE
                break
        client.connect(str(server.path))  # waits in the backlog: accept has no fd to give
        wait_for(lambda: server.accept_failures >= 3, "three failed accepts")
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with client:
        framing.send(client, request())
        response = reply_of(client)
        assert response.error_code == ""
        for fd in framing.receive_fds(client, response.fd_count):
            os.close(fd)
    (failing,) = records.named("handles.accept_failing")  # one line for the burst
    assert failing.__dict__["why"] == "EMFILE: Too many open files"
    (recovered,) = records.named("handles.accept_recovered")
    assert recovered.__dict__["failures"] >= 3
    assert server.accept_failures == 0


@pytest.mark.parametrize(
    "code",
    [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EINTR],
)
def test_accept_errors_back_off_and_never_end_the_loop(
    make_server: MakeServer, records: Records, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    real_accept = socket.socket.accept
    failures = 5

    def flaky(sock: socket.socket) -> tuple[socket.socket, Any]:
        nonlocal failures
        if failures:
            failures -= 1
            raise OSError(code, os.strerror(code))
        return real_accept(sock)

    server = make_server()
    monkeypatch.setattr(socket.socket, "accept", flaky)
    grant = request_lease(server.path, 0, 0, "after-errors")
    grant.close()
    assert grant.response.error_code == ""
    assert failures == 0
    assert len(records.named("handles.accept_failing")) == 1
    (recovered,) = records.named("handles.accept_recovered")
    assert recovered.__dict__["failures"] == 5


# -- the client checks who serves it ----------------------------------------------------------
def test_the_client_sends_nothing_to_a_daemon_of_a_uid_it_does_not_accept() -> None:
    directory = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    stranger = os.getuid() + 12345
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(directory / "handles.sock"))
            listener.listen(1)
            with pytest.raises(AttachError) as e:
                request_lease(directory / "handles.sock", 0, 0, "x", daemon_users=str(stranger))
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(20)
                assert conn.recv(4096) == b""  # closed without a byte
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    me = pwd.getpwuid(os.getuid()).pw_name
    assert str(e.value) == (
        f"tidalpoold at {directory / 'handles.sock'} runs as uid {os.getuid()} ({me}), a user"
        f" this client does not accept (accepted: uid {stranger}); to trust another user, list"
        " it in daemon_users= or TIDALPOOL_DAEMON_USERS (comma-separated user names or uids)"
    )


def test_daemon_users_are_names_or_uids() -> None:
    me = pwd.getpwuid(os.getuid())
    assert accepted_uids("root") == (0,)
    assert accepted_uids("0") == (0,)
    assert accepted_uids(f" root , {me.pw_name},0,4242 ") == tuple(
        dict.fromkeys((0, me.pw_uid, 4242))
    )
    with pytest.raises(AttachError) as e:
        accepted_uids("root,no-such-user-tp", "TIDALPOOL_DAEMON_USERS")
    assert str(e.value) == (
        "TIDALPOOL_DAEMON_USERS names the user 'no-such-user-tp', which does not exist on this"
        " machine (give user names or uids, comma-separated)"
    )
    with pytest.raises(AttachError, match=r"^daemon_users is ' , ': it names no user"):
        accepted_uids(" , ")


def test_by_default_the_client_accepts_its_own_uid_and_the_tidalpool_user(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = pwd.getpwnam

    def without_tidalpool(name: str) -> pwd.struct_passwd:
        if name == "tidalpool":
            raise KeyError(name)
        return real(name)

    def with_tidalpool(name: str) -> pwd.struct_passwd:
        if name == "tidalpool":
            return pwd.struct_passwd(("tidalpool", "x", 4321, 4321, "", "/", "/bin/false"))
        return real(name)

    monkeypatch.setattr(pwd, "getpwnam", without_tidalpool)
    assert accepted_uids(None) == (os.getuid(),)
    monkeypatch.setattr(pwd, "getpwnam", with_tidalpool)
    assert accepted_uids(None) == (os.getuid(), 4321)


def test_a_refusal_sent_before_the_request_went_out_is_still_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon that answered and closed before the client's request was out: the client's
    send fails (EPIPE), and it reads the answer that waits for it rather than reporting that."""
    directory = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    closed = threading.Event()
    refusal = handles_pb2.HandlesResponse(error_code="PERMISSION_DENIED", error_message="no")
    real_send = framing.send

    def serve(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn:
            real_send(conn, refusal)
        closed.set()

    def late_send(sock: socket.socket, msg: Any, fds: Any = ()) -> None:
        assert closed.wait(20), "the server never closed"
        real_send(sock, msg, fds)

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(directory / "handles.sock"))
            listener.listen(1)
            server = threading.Thread(target=serve, args=(listener,))
            server.start()
            monkeypatch.setattr(framing, "send", late_send)
            with pytest.raises(AttachError) as e:
                request_lease(directory / "handles.sock", 0, 0, "x")
            server.join()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert str(e.value) == "tidalpoold refused the session (PERMISSION_DENIED): no"
