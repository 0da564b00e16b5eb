"""The handles socket: checks who connects, opens their session, passes its memory.

One short exchange per connection, the peer judged before a byte of it is read (a lease, or
since version 3 the give-back of a lease whose Attach failed):

    accept ─▶ SO_PEERCRED, admit() ─▶ read one HandlesRequest ─▶ worker: open the session,
      │            │ refused            (one deadline for it)       reply, then the fds
      │            ▼
      │     error reply, SHUT_WR, drain what it sent (bounded, same deadline), close
      ▼
    at max_connections: the rest wait in the listen backlog; while one waits, a connection
    without a whole request (past a short grace) is dropped to make room: the oldest of the
    process that holds the most, once what it sent is read

A peer of another uid is admitted only if one of its groups is allowed. The reply carries the
session token and its lease (chunk indices), followed by the fds of exactly those chunks
(SCM_RIGHTS, in batches of at most 253): a client never holds a handle to another session's
memory. The Attach RPC confirms the lease.

One selector thread accepts, checks and reads every connection without blocking, so a slow or
silent peer costs an fd and a few bytes, never another peer's time; a thread per connection
would spend a thread per silent peer and need a way to interrupt each. A whole request goes to
a pool of max_connections workers (registry.open and the sends are the only calls that may
wait), so a connection being served never waits for a worker.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError
from tidalcore import framing
from tidalcore.errors import (
    Failure,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    status_of,
)
from tidalcore.v1 import common_pb2, handles_pb2
from tidalcore.wire import HANDLES_ELASTIC_VERSION, HANDLES_GIVE_BACK_VERSION, HANDLES_VERSION

from tidalpoold.backends.base import Backend
from tidalpoold.sessions import Reason, Registry, lease_message, pool_lease

log = logging.getLogger("tidalpoold.handles")

_PEERCRED = struct.Struct("3i")
_LEN = struct.Struct("<I")  # the framing's length prefix (tidalcore.framing)
# What a refused peer may still have in flight: one whole request. Reading it before closing
# lets the peer finish its send and read the refusal; more than that is not waited for.
_DRAIN_BYTES = _LEN.size + framing.MAX_MESSAGE
# A connection this young is never dropped to make room for another. A client sends its request
# as soon as it connects, in microseconds; only on a socket crowded by other peers does a client
# slower than this lose its place. It sets what a client waits behind hostile peers: about one
# grace at most.
_GRACE_S = 0.05
_BACKOFF_S = (0.01, 0.5)  # first and longest wait before accept is tried again after an error
_SEND_FLOOR_S = 0.1  # the reply's sends get the rest of the deadline, but at least this


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


@dataclass(eq=False)
class _Conn:
    """A connection the selector thread holds: reading its request, or draining a refused one."""

    sock: socket.socket
    peer: Peer
    accepted: float
    deadline: float
    data: bytearray = field(default_factory=bytearray)
    refused: bool = False  # answered with an error: what it sends is read and dropped
    drained: int = 0


class HandlesServer:
    """Serves the handles socket from a background thread (see the module docstring).

    `timeout_s` is the one deadline a peer has to send its whole request (the reply gets what
    is left of it); `max_connections` bounds the connections held at once, read or served.
    """

    def __init__(
        self,
        path: Path,
        registry: Registry,
        mode: int,
        allowed_gids: tuple[int, ...],
        *,
        timeout_s: float = 2.0,
        max_connections: int = 64,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be greater than 0, got {timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.path = path
        self.registry = registry
        self.allowed_gids = allowed_gids
        self.own_uid = os.getuid()
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._grace_s = min(_GRACE_S, timeout_s / 4)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, mode)
        self._sock.listen(max(64, max_connections))
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._listening = False
        self._conns: dict[_Conn, None] = {}  # in order of acceptance: of deadline, too
        self._serving: set[_Conn] = set()  # handed to a worker; guarded by _lock
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(max_connections, thread_name_prefix="handles")
        self._closing = threading.Event()
        self._retry_at = 0.0  # accept is not tried before this (after an error)
        self._backoff_s = 0.0
        self._failures = 0  # accept errors in the current burst
        self._failing_since = 0.0
        self._crowded = 0  # connections dropped for waiting peers in the current burst
        self._crowded_since = 0.0
        self._thread = threading.Thread(target=self._loop, name="handles", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def accept_failures(self) -> int:
        """accept() errors in the current burst: 0 while accepting works."""
        return self._failures

    def close(self) -> None:
        """Stop accepting, drop the connections being read, cut short the ones being served
        (a lease not yet handed over goes back), wait for the workers, remove the socket."""
        self._closing.set()
        self._wake()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        else:
            self._teardown()
        with self._lock:
            for conn in self._serving:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
        self._workers.shutdown(wait=True)
        self._wake_r.close()
        self._wake_w.close()
        self.path.unlink(missing_ok=True)

    # -- the selector thread --------------------------------------------------------------------
    def _loop(self) -> None:
        """Until close(): nothing else ends it (an unexpected error is logged, then the loop
        goes on after a pause)."""
        try:
            while not self._closing.is_set():
                try:
                    self._step()
                except Exception:
                    log.exception("handles.loop_failed")
                    self._closing.wait(0.1)
        finally:
            self._teardown()

    def _step(self) -> None:
        now = time.monotonic()
        self._expire(now)
        self._watch_listener(now)
        for key, _ in self._selector.select(self._wait(now)):
            if key.fileobj is self._sock:
                self._accept()
            elif key.data is None:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            elif key.data in self._conns:  # not dropped by an earlier event of this round
                self._readable(key.data)

    def _held(self) -> int:
        with self._lock:
            return len(self._conns) + len(self._serving)

    def _droppable(self) -> list[_Conn]:
        """The connections a waiting peer may take the place of: those of the process (or
        processes, tied) holding the most, oldest first. Which of them is past its grace is
        asked apart: a process whose connections are all young is waited for, never spared
        at another's cost."""
        held = Counter(c.peer.pid for c in self._conns)
        most = max(held.values(), default=0)
        return [c for c in self._conns if held[c.peer.pid] == most]

    def _oldest_droppable(self, now: float) -> _Conn | None:
        """The first of `_droppable` past its grace (they are in order: the oldest first)."""
        first = next(iter(self._droppable()), None)
        return first if first is not None and now - first.accepted >= self._grace_s else None

    def _watch_listener(self, now: float) -> None:
        """Listen while there is room, or a connection to drop for a waiting peer; not while
        accept backs off after an error."""
        want = now >= self._retry_at and (
            self._held() < self.max_connections or self._oldest_droppable(now) is not None
        )
        if want != self._listening:
            if want:
                self._selector.register(self._sock, selectors.EVENT_READ, None)
            else:
                self._selector.unregister(self._sock)
            self._listening = want

    def _wait(self, now: float) -> float | None:
        """Seconds until something is due: a deadline, the end of a backoff, or the oldest
        connection's grace ending while there is no room (None: only an event is)."""
        due: list[float] = []
        oldest = next(iter(self._conns), None)
        if oldest is not None:
            due.append(oldest.deadline)
            if not self._listening:
                due.append(self._droppable()[0].accepted + self._grace_s)
        if now < self._retry_at:
            due.append(self._retry_at)
        return max(0.0, min(due) - now) if due else None

    def _expire(self, now: float) -> None:
        while self._conns:
            conn = next(iter(self._conns))
            if conn.deadline > now:
                return
            if not conn.refused:
                self._drop(conn, f"no whole request within {self.timeout_s:g} s")
            else:
                self._forget(conn)

    def _accept(self) -> None:
        """Accept what waits, as room allows; an error backs off and never ends the loop."""
        for _ in range(self.max_connections):
            now = time.monotonic()
            victim = None
            if self._held() >= self.max_connections:
                victim = self._victim(now)
                if victim is None:
                    return
            try:
                sock, _ = self._sock.accept()
            except BlockingIOError:
                self._uncrowded(now)
                return
            except OSError as e:
                self._accept_failed(e, now)
                return
            self._accept_recovered(now)
            if victim is not None:
                self._make_room(victim, now)
            self._admit(sock, now)

    def _victim(self, now: float) -> _Conn | None:
        """The connection to drop for a peer that waits: the oldest of the process holding the
        most, once past its grace (None before: it is waited for), so a flood from one process
        never costs another its place while the flood holds more, however fast it reconnects.
        A request that arrived whole but is not read yet is read and served first (it was
        never slow), and the choice made again."""
        while True:
            victim = self._oldest_droppable(now)
            if victim is None or victim.refused:
                return victim
            self._readable(victim)
            if victim in self._conns:
                return victim

    def _make_room(self, victim: _Conn, now: float) -> None:
        """Drop the victim (see _victim) for a peer that waits: a client sends its request as
        soon as it connects, so that one is slow, silent or refused. One log line when this
        starts (naming the first peer dropped), one when it ends."""
        why = (
            f"no whole request after {now - victim.accepted:.2f} s while the handles socket"
            f" holds its {self.max_connections} connections and another peer waits"
        )
        if self._crowded == 0:
            self._crowded_since = now
            log.warning(
                "handles.crowded",
                extra={"pid": victim.peer.pid, "uid": victim.peer.uid, "why": why},
            )
        self._crowded += 1
        if victim.refused:
            self._forget(victim)
        else:
            self._drop(victim, why, level=logging.DEBUG)

    def _uncrowded(self, now: float) -> None:
        """No peer waits any more: the end of a burst of drops, if there was one."""
        if self._crowded:
            log.info(
                "handles.uncrowded",
                extra={"dropped": self._crowded, "seconds": round(now - self._crowded_since, 3)},
            )
            self._crowded = 0

    def _accept_failed(self, e: OSError, now: float) -> None:
        """One log line per burst of failures (EMFILE, ENOBUFS...), then a growing backoff:
        connections still held finish meanwhile and give their fds back."""
        if self._failures == 0:
            self._failing_since = now
            log.warning(
                "handles.accept_failing",
                extra={"why": f"{errno.errorcode.get(e.errno or 0, e.errno)}: {e.strerror or e}"},
            )
        self._failures += 1
        self._backoff_s = min(max(self._backoff_s * 2, _BACKOFF_S[0]), _BACKOFF_S[1])
        self._retry_at = now + self._backoff_s

    def _accept_recovered(self, now: float) -> None:
        if self._failures:
            log.info(
                "handles.accept_recovered",
                extra={"failures": self._failures, "seconds": round(now - self._failing_since, 3)},
            )
        self._failures, self._backoff_s = 0, 0.0

    def _admit(self, sock: socket.socket, now: float) -> None:
        """Judge the peer before reading anything of it; a refused one is answered at once."""
        try:
            sock.setblocking(False)
            peer = peer_of(sock)
        except OSError as e:
            log.warning("handles.bad_peer", extra={"why": str(e)})
            sock.close()
            return
        conn = _Conn(sock, peer, now, now + self.timeout_s)
        with self._lock:
            self._conns[conn] = None
        self._selector.register(sock, selectors.EVENT_READ, conn)
        try:
            admit(peer, self.own_uid, self.allowed_gids)
        except PermissionDenied as e:
            self._refuse(conn, e)
            return
        self._readable(conn)  # a client's request is usually there already: serve it now

    def _readable(self, conn: _Conn) -> None:
        if conn.refused:
            self._drain(conn)
            return
        try:
            size = _LEN.size
            if len(conn.data) >= size:
                size += _LEN.unpack_from(conn.data)[0]
            got = conn.sock.recv(size - len(conn.data))  # fds sent along are dropped unread
        except BlockingIOError:
            return
        except OSError as e:
            self._drop(conn, str(e), reply=False)
            return
        if not got:
            self._drop(conn, f"closed after {len(conn.data)} bytes of its request", reply=False)
            return
        conn.data += got
        if len(conn.data) < _LEN.size:
            return
        (length,) = _LEN.unpack_from(conn.data)
        if length > framing.MAX_MESSAGE:
            self._refuse(
                conn,
                InvalidArgument(
                    f"request of {length} bytes exceeds the limit of {framing.MAX_MESSAGE}"
                ),
            )
            return
        if len(conn.data) < _LEN.size + length:
            return
        try:
            request = handles_pb2.HandlesRequest.FromString(bytes(conn.data[_LEN.size :]))
        except DecodeError as e:
            self._refuse(conn, InvalidArgument(f"malformed tidalpool.v1.HandlesRequest: {e}"))
            return
        self._selector.unregister(conn.sock)
        with self._lock:
            del self._conns[conn]
            self._serving.add(conn)
        self._workers.submit(self._serve, conn, request)

    def _drain(self, conn: _Conn) -> None:
        """Read and drop what a refused peer sends; close at its end or after one request."""
        try:
            got = conn.sock.recv(min(65536, _DRAIN_BYTES - conn.drained))
        except BlockingIOError:
            return
        except OSError:
            got = b""
        conn.drained += len(got)
        if not got or conn.drained >= _DRAIN_BYTES:
            self._forget(conn)

    def _refuse(self, conn: _Conn, failure: Failure) -> None:
        """Answer with the error, shut our side, and read what the peer still sends before
        closing: closing on unread bytes, or before the peer's request has gone out, would
        fail its send (EPIPE) and it would never read why it was refused. What it sends is
        read under the same deadline and up to one whole request, then it is closed anyway."""
        code, message = status_of(failure)
        log.warning(
            "handles.refused", extra={"pid": conn.peer.pid, "uid": conn.peer.uid, "why": message}
        )
        self._reply_quietly(conn, code.name, message)
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_WR)
        conn.refused, conn.data = True, bytearray()

    def _drop(self, conn: _Conn, why: str, reply: bool = True, level: int = logging.INFO) -> None:
        """Close a connection that sent no whole request, telling it why if it still listens."""
        log.log(
            level, "handles.dropped", extra={"pid": conn.peer.pid, "uid": conn.peer.uid, "why": why}
        )
        if reply:
            self._reply_quietly(conn, ResourceExhausted.code.name, why)
        self._forget(conn)

    @staticmethod
    def _reply_quietly(conn: _Conn, code: str, message: str) -> None:
        """An error reply, if it fits at once in the socket (it does in a fresh one)."""
        reply = handles_pb2.HandlesResponse(error_code=code, error_message=message)
        with contextlib.suppress(OSError):
            framing.send(conn.sock, reply)

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _teardown(self) -> None:
        for conn in list(self._conns):
            self._forget(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._sock)
        self._listening = False
        self._sock.close()
        self._selector.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # -- the workers ----------------------------------------------------------------------------
    def _serve(self, conn: _Conn, request: handles_pb2.HandlesRequest) -> None:
        """Open the session and hand it over, within what is left of the deadline."""
        peer = conn.peer
        try:
            conn.sock.settimeout(max(conn.deadline - time.monotonic(), _SEND_FLOOR_S))
            try:
                if request.give_back_token and request.version == HANDLES_GIVE_BACK_VERSION:
                    given = self.registry.give_back(request.give_back_token, peer.uid)
                    log.info(
                        "handles.given_back",
                        extra={"session": given.id, "pid": peer.pid, "uid": peer.uid},
                    )
                    framing.send(conn.sock, handles_pb2.HandlesResponse(session_id=given.id))
                    return
                if request.grow_token and request.version == HANDLES_ELASTIC_VERSION:
                    self._grow(conn, request.grow_token)
                    return
                elastic = request.elastic and request.version == HANDLES_ELASTIC_VERSION
                if (request.version != HANDLES_VERSION and not elastic) or request.give_back_token:
                    kind, version = (
                        ("give-back", HANDLES_GIVE_BACK_VERSION)
                        if request.give_back_token
                        else ("lease", HANDLES_VERSION)
                    )
                    raise InvalidArgument(
                        f"handles protocol version {request.version} is not supported for a"
                        f" {kind} request ({version}; an elastic lease or a grow:"
                        f" {HANDLES_ELASTIC_VERSION})"
                    )
                session = self.registry.open(
                    request.device_bytes,
                    request.host_bytes,
                    request.job_name,
                    peer.pid,
                    peer.uid,
                    elastic=elastic,
                    device_min=request.device_min_bytes,
                )
            except Failure as e:
                code, message = status_of(e)
                log.warning(
                    "handles.refused", extra={"pid": peer.pid, "uid": peer.uid, "why": message}
                )
                framing.send(
                    conn.sock,
                    handles_pb2.HandlesResponse(error_code=code.name, error_message=message),
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
            if session.elastic is not None:
                reply.device_floor_chunks = session.elastic.floor
                reply.device_ceiling_chunks = session.elastic.most
            try:
                framing.send(conn.sock, reply)
                framing.send_fds(conn.sock, fds)
            except OSError as e:  # its chunks go back to the pools now, not at attach_timeout_s
                self.registry.end_quietly(
                    session.id, Reason.REASON_DETACHED, f"its lease could not be handed over: {e}"
                )
                raise
        except OSError as e:
            log.warning("handles.bad_peer", extra={"pid": peer.pid, "uid": peer.uid, "why": str(e)})
        except Exception:
            log.exception("handles.failed", extra={"pid": peer.pid, "uid": peer.uid})
        finally:
            with self._lock:
                self._serving.discard(conn)
            conn.sock.close()
            self._wake()  # a slot is free: the selector may listen again

    def _grow(self, conn: _Conn, token: str) -> None:
        """Chunks up to an elastic session's quota (`Registry.grow`), and their fds; a Failure
        is answered by the caller."""
        peer = conn.peer
        session, added = self.registry.grow(token, peer.uid)
        backend = self.registry.backend
        fds = lease_fds(backend, added.chunks, ())
        reply = handles_pb2.HandlesResponse(
            session_id=session.id,
            lease=common_pb2.Lease(
                device=pool_lease(added), backend=backend.name, mode=backend.mode
            ),
            fd_count=len(fds),
        )
        try:
            framing.send(conn.sock, reply)
            framing.send_fds(conn.sock, fds)
        except OSError as e:  # the session's lease holds them: it ends, and they go back
            self.registry.end_quietly(
                session.id,
                Reason.REASON_EVICTED,
                f"chunks it grew by could not be handed over: {e}",
            )
            raise


def lease_fds(backend: Backend, device: tuple[int, ...], host: tuple[int, ...]) -> list[int]:
    """The fds a session receives: its device chunks' (none in "ipc" mode), then its host
    chunks', each in lease order. Only these; never another chunk's."""
    fds = [] if backend.mode == "ipc" else [backend.device.chunks[i].fd for i in device]
    return fds + [backend.host.chunks[i].fd for i in host]
