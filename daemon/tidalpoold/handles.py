"""The handles socket: checks who connects, opens their session, passes its memory.

One short exchange per connection: the peer's credentials are read with
SO_PEERCRED (a peer of another uid is admitted only if one of its groups is
allowed), one HandlesRequest is read, a session is opened, and the reply
carries the session token and its lease (chunk indices), followed by the fds of
exactly those chunks (SCM_RIGHTS, in batches of at most 253): a client never
holds a handle to another session's memory. The Attach RPC confirms the lease.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from tidalcore import framing
from tidalcore.errors import Failure, InvalidArgument, PermissionDenied, status_of
from tidalcore.v1 import handles_pb2
from tidalcore.wire import HANDLES_VERSION

from tidalpoold.backends.base import Backend
from tidalpoold.sessions import Registry, lease_message

log = logging.getLogger("tidalpoold.handles")

_PEERCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(conn: socket.socket) -> Peer:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return Peer(*_PEERCRED.unpack(raw))


def peer_groups(peer: Peer) -> set[int]:
    """The peer's primary and supplementary groups (from /proc; primary only if unreadable)."""
    groups = {peer.gid}
    try:
        for line in Path(f"/proc/{peer.pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                groups.update(int(g) for g in line.split()[1:])
    except OSError:
        pass
    return groups


def admit(peer: Peer, own_uid: int, allowed_gids: tuple[int, ...]) -> None:
    """Raise PermissionDenied unless the peer is this uid or in an allowed group."""
    if peer.uid == own_uid:
        return
    if allowed_gids and peer_groups(peer) & set(allowed_gids):
        return
    raise PermissionDenied(
        f"uid {peer.uid} (pid {peer.pid}) may not use this daemon: it runs as uid {own_uid}"
        + (f" and admits groups {list(allowed_gids)}" if allowed_gids else " and admits no groups")
    )


class HandlesServer:
    """Accepts connections on the handles socket in a background thread."""

    def __init__(
        self, path: Path, registry: Registry, mode: int, allowed_gids: tuple[int, ...]
    ) -> None:
        self.path = path
        self.registry = registry
        self.allowed_gids = allowed_gids
        self.own_uid = os.getuid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, mode)
        self._sock.listen(64)
        self._closing = False
        self._thread = threading.Thread(target=self._accept_loop, name="handles", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=2)
        self.path.unlink(missing_ok=True)

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5.0)
                try:
                    self._serve(conn)
                except (OSError, framing.FramingError) as e:
                    log.warning("handles.bad_peer", extra={"why": str(e)})

    def _serve(self, conn: socket.socket) -> None:
        peer = peer_of(conn)
        try:
            # Read the request before judging the peer: closing on unread data would reset the
            # connection and the peer would never read why it was refused.
            request, fds = framing.receive(conn, handles_pb2.HandlesRequest)
            for fd in fds:  # a client has no business sending fds
                os.close(fd)
            admit(peer, self.own_uid, self.allowed_gids)
            if request.version != HANDLES_VERSION:
                raise InvalidArgument(
                    f"handles protocol version {request.version} is not supported"
                    f" ({HANDLES_VERSION})"
                )
            session = self.registry.open(
                request.device_bytes, request.host_bytes, request.job_name, peer.pid, peer.uid
            )
        except Failure as e:
            code, message = status_of(e)
            log.warning("handles.refused", extra={"pid": peer.pid, "uid": peer.uid, "why": message})
            framing.send(
                conn, handles_pb2.HandlesResponse(error_code=code.name, error_message=message)
            )
            return
        backend = self.registry.backend
        fds = lease_fds(backend, session.device.chunks, session.host.chunks)
        reply = handles_pb2.HandlesResponse(
            session_id=session.id,
            token=session.token,
            lease=lease_message(session, backend),
            fd_count=len(fds),
            ipc_handle=backend.device.ipc_handle if backend.mode == "ipc" else b"",
        )
        framing.send(conn, reply)
        framing.send_fds(conn, fds)


def lease_fds(backend: Backend, device: tuple[int, ...], host: tuple[int, ...]) -> list[int]:
    """The fds a session receives: its device chunks' (none in "ipc" mode), then its host
    chunks', each in lease order. Only these; never another chunk's."""
    fds = [] if backend.mode == "ipc" else [backend.device.chunks[i].fd for i in device]
    return fds + [backend.host.chunks[i].fd for i in host]
