"""The client side of the handles socket: check who serves it, ask for a lease, receive its
chunks' fds; give a lease back whose Attach failed.

The daemon's uid (SO_PEERCRED) is checked before a byte is sent: a socket in a directory others
can write to may be served by anyone, who would learn the job's name, uid and pid and hand it
memory they control. Accepted by default: this process's uid and the system user "tidalpool"
(the systemd unit's User=).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import resource
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tidalcore import framing
from tidalcore.v1 import handles_pb2
from tidalcore.wire import HANDLES_ELASTIC_VERSION, HANDLES_GIVE_BACK_VERSION, HANDLES_VERSION

from tidalclient.errors import AttachError

DAEMON_USERS_ENV = "TIDALPOOL_DAEMON_USERS"
DAEMON_USER = "tidalpool"  # the user the systemd unit runs the daemon as
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_TIMEVAL = struct.Struct("ll")  # struct timeval: seconds, microseconds


@dataclass(frozen=True, slots=True)
class Grant:
    """A granted lease: the response, and the fds of its chunks in lease order (no device fds
    in "ipc" mode). The caller maps them, then closes them with `close()`."""

    response: handles_pb2.HandlesResponse
    device_fds: tuple[int, ...]
    host_fds: tuple[int, ...]
    daemon_uid: int = -1  # the daemon's uid, as the kernel gave it (SO_PEERCRED)

    def close(self) -> None:
        for fd in (*self.device_fds, *self.host_fds):
            os.close(fd)


def request_lease(
    path: Path,
    device_bytes: int,
    host_bytes: int,
    job_name: str,
    timeout: float = 10.0,
    daemon_users: str | None = None,
    device_min: int | None = None,
) -> Grant:
    """One exchange on the handles socket; AttachError names why it failed. `device_min`
    (0: the daemon's default) asks for an elastic lease: that floor, `device_bytes` its
    ceiling (0: the whole pool); the grant holds the floor's chunks.

    The daemon must run as a user this client accepts, checked before anything is sent:
    `daemon_users`, comma-separated user names or uids ("root" or "0" for a daemon run as
    root), replaces the defaults (this process's uid and the user "tidalpool" if it exists);
    when it is None, $TIDALPOOL_DAEMON_USERS gives it if set and not empty.
    """
    request = handles_pb2.HandlesRequest(
        version=HANDLES_VERSION,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        job_name=job_name,
    )
    if device_min is not None:
        request.version, request.elastic = HANDLES_ELASTIC_VERSION, True
        request.device_min_bytes = device_min
    return _granted(path, request, timeout, daemon_users)


def grow(path: Path, token: str, timeout: float = 10.0, daemon_users: str | None = None) -> Grant:
    """Take device chunks up to an elastic session's quota (version 4 of the handles
    protocol): the grant names only the chunks added (none when none is free), with their
    fds. AttachError names why it failed."""
    request = handles_pb2.HandlesRequest(version=HANDLES_ELASTIC_VERSION, grow_token=token)
    return _granted(path, request, timeout, daemon_users)


def _granted(
    path: Path, request: handles_pb2.HandlesRequest, timeout: float, daemon_users: str | None
) -> Grant:
    """The lease `request` is answered with, and its fds."""
    with _connected(path, timeout, daemon_users) as (sock, daemon_uid):
        try:
            response = _exchange(sock, request)
            if response.error_code:
                raise AttachError(
                    f"tidalpoold refused the session ({response.error_code}):"
                    f" {response.error_message}"
                )
            expected = _expected_fds(response)
            if response.fd_count != expected:
                raise AttachError(
                    f"tidalpoold announced {response.fd_count} file descriptors for a lease of"
                    f" {expected} chunks"
                )
            _make_fd_room(expected)
            fds = framing.receive_fds(sock, expected)
        except (OSError, framing.FramingError) as e:
            raise AttachError(f"tidalpoold at {path} closed the handles exchange: {e}") from e
    n_device = expected - len(response.lease.host.chunks)
    return Grant(response, tuple(fds[:n_device]), tuple(fds[n_device:]), daemon_uid)


def give_back(
    path: Path, token: str, timeout: float = 2.0, daemon_users: str | None = None
) -> None:
    """Give back a lease whose Attach failed (version 3 of the handles protocol): the daemon
    ends its session now, not at its attach_timeout_s, so a job that tries again is not
    refused for the leases its failed tries still hold. AttachError names why it could not be
    given back (the lease then goes back at attach_timeout_s)."""
    request = handles_pb2.HandlesRequest(version=HANDLES_GIVE_BACK_VERSION, give_back_token=token)
    with _connected(path, timeout, daemon_users) as (sock, _daemon_uid):
        try:
            response = _exchange(sock, request)
        except (OSError, framing.FramingError) as e:
            raise AttachError(f"tidalpoold at {path} closed the handles exchange: {e}") from e
    if response.error_code:
        raise AttachError(
            f"tidalpoold did not take the lease back ({response.error_code}):"
            f" {response.error_message}"
        )


@contextlib.contextmanager
def _connected(
    path: Path, timeout: float, daemon_users: str | None
) -> Iterator[tuple[socket.socket, int]]:
    """A connection to the handles socket at `path` and the daemon's uid, once that uid is
    one this client accepts (`request_lease`); AttachError otherwise."""
    if daemon_users is not None:
        accepted = accepted_uids(daemon_users, "daemon_users")
    else:
        accepted = accepted_uids(os.environ.get(DAEMON_USERS_ENV) or None, DAEMON_USERS_ENV)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        try:
            # A blocking connect waits (up to SO_SNDTIMEO) for room in a full listen backlog,
            # where one with a timeout would fail at once (EAGAIN).
            seconds = max(timeout, 0.001)
            sock.setsockopt(
                socket.SOL_SOCKET,
                socket.SO_SNDTIMEO,
                _TIMEVAL.pack(int(seconds), int(seconds % 1 * 1_000_000)),
            )
            sock.connect(str(path))
            sock.settimeout(timeout)
            _pid, daemon_uid, _gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
        except BlockingIOError as e:
            raise AttachError(
                f"cannot reach tidalpoold at {path}: its handles socket had no room for another"
                f" connection for {timeout:g} s"
            ) from e
        except OSError as e:
            raise AttachError(f"cannot reach tidalpoold at {path}: {e.strerror or e}") from e
        if daemon_uid not in accepted:
            raise AttachError(
                f"tidalpoold at {path} runs as {_who(daemon_uid)}, a user this client does not"
                f" accept (accepted: {', '.join(_who(u) for u in accepted)}); to trust another"
                f" user, list it in daemon_users= or {DAEMON_USERS_ENV} (comma-separated user"
                " names or uids)"
            )
        yield sock, daemon_uid


def _exchange(
    sock: socket.socket, request: handles_pb2.HandlesRequest
) -> handles_pb2.HandlesResponse:
    """Send `request`, receive the response (OSError, FramingError when either fails)."""
    try:
        framing.send(sock, request)
    except (BrokenPipeError, ConnectionResetError):
        # A daemon that refused this peer may have answered and gone before the request was
        # out: its answer, if it is there, says why.
        response = _answer_if_any(sock)
        if response is None or not response.error_code:
            raise
        return response
    response, stray = framing.receive(sock, handles_pb2.HandlesResponse)
    for fd in stray:  # fds come in the batches that follow, never with the response
        os.close(fd)
    return response


def accepted_uids(daemon_users: str | None, source: str = "daemon_users") -> tuple[int, ...]:
    """The uids a daemon may run as: those `daemon_users` names (comma-separated user names or
    uids), or for None this process's uid and the user "tidalpool"'s if it exists. `source`
    names where the list came from in the AttachError an unknown user or an empty list gets."""
    if daemon_users is None:
        uids = [os.getuid()]
        with contextlib.suppress(KeyError):
            uids.append(pwd.getpwnam(DAEMON_USER).pw_uid)
        return tuple(dict.fromkeys(uids))
    found: list[int] = []
    for item in daemon_users.split(","):
        name = item.strip()
        if not name:
            continue
        if name.isascii() and name.isdigit():
            found.append(int(name))
            continue
        try:
            found.append(pwd.getpwnam(name).pw_uid)
        except KeyError:
            raise AttachError(
                f"{source} names the user {name!r}, which does not exist on this machine"
                " (give user names or uids, comma-separated)"
            ) from None
    if not found:
        raise AttachError(
            f"{source} is {daemon_users!r}: it names no user (give user names or uids,"
            " comma-separated)"
        )
    return tuple(dict.fromkeys(found))


def _who(uid: int) -> str:
    """ "uid 0 (root)", or "uid 12345" for a uid without a name here."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _answer_if_any(sock: socket.socket) -> handles_pb2.HandlesResponse | None:
    """The response already waiting on `sock`, if a whole one is there."""
    try:
        response, stray = framing.receive(sock, handles_pb2.HandlesResponse)
    except (OSError, framing.FramingError):
        return None
    for fd in stray:
        os.close(fd)
    return response


def _expected_fds(response: handles_pb2.HandlesResponse) -> int:
    lease = response.lease
    device = 0 if lease.mode == "ipc" else len(lease.device.chunks)
    return device + len(lease.host.chunks)


def _make_fd_room(n: int) -> None:
    """Raise the soft open-files limit toward the hard one if `n` more fds might not fit (they
    are closed again once mapped, but they all arrive before the first is mapped)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    need = len(os.listdir("/proc/self/fd")) + n + 64
    if need > soft and (hard == resource.RLIM_INFINITY or hard > soft):
        new_soft = need if hard == resource.RLIM_INFINITY else min(hard, max(need, soft))
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
