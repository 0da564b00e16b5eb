"""tidalpool.sock's front door: the daemon accepts every connection itself, knows whose it is,
and passes on to the gRPC server only one that has begun to speak HTTP/2.

gRPC's server accepts on its own socket and cannot say whose a connection is, so a cap on its
connections is one for every uid: one local user's flood of silent connections took every place
and kept other users' jobs from attaching while it lasted. Here the gRPC server listens on a
socket of the daemon's uid alone (`inner`), and one selector thread serves the public one:

    accept ─▶ SO_PEERCRED ─▶ waiting: the 24-byte HTTP/2 preface within `handshake_s`
                                │  room for `waiting` at once; one more and the process
                                │  holding the most, of the uid holding the most, loses
                                │  one: the newcomer if it is theirs, else their oldest
                                ▼
                     a place free for its uid? ── no ──▶ closed
                                │ yes
                                ▼
                     relayed: bytes both ways to `inner`, until either side ends

A uid holds at most `places - reserved` places, so whatever one uid opens, `reserved` places
are left for the others; a flood from one process never costs another process its place in
the waiting room, however fast it reconnects. With every place held (several uids together),
a newcomer whose uid holds fewer than the uid holding the most, less one, takes the place of
that uid's connection that has been quiet longest, once it has passed no byte for `quiet_s`
(a session's channel carries its heartbeat every second; a channel that lost its place
connects again at its next call). Past the preface, the gRPC server's own limits
apply (its handshake timeout, streams per connection, idle connections closed).

A relayed connection costs three fds (the peer's, ours to `inner`, gRPC's end of it) and at
most two reads' worth of buffered bytes; a waiting one, one fd and 24 bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tidalpoold.handles import Peer, peer_of

log = logging.getLogger("tidalpoold.front")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what every HTTP/2 client sends first (RFC 9113)
READ_BYTES = 256 * 1024  # one read's most: a relayed direction buffers at most this
FDS_PER_PLACE = 3  # a relayed connection: the peer's socket, ours to the gRPC server, gRPC's
LOG_EVERY_S = 10.0  # a warning of refused connections at most this often
ACCEPTS_PER_ROUND = 256  # then the loop reads what the others sent


@dataclass(eq=False)
class _Waiting:
    """A connection that has not yet sent the whole HTTP/2 preface."""

    sock: socket.socket
    peer: Peer
    deadline: float
    data: bytes = b""


@dataclass(eq=False)
class _Pair:
    """A relayed connection: `outer` is the peer's socket, `inner` ours to the gRPC server.
    `to_inner`/`to_outer`: bytes read from one side not yet written to the other; `ended`:
    the sides that have closed their sending half (what they sent is all passed on once
    their buffer is empty)."""

    outer: socket.socket
    inner: socket.socket
    uid: int
    last: float  # when bytes last passed, either way (monotonic seconds)
    to_inner: bytearray = field(default_factory=bytearray)
    to_outer: bytearray = field(default_factory=bytearray)
    ended: set[socket.socket] = field(default_factory=set)

    def sides(self, sock: socket.socket) -> tuple[socket.socket, bytearray, bytearray]:
        """Of one of the pair's sockets: the other socket, the bytes read from this one not
        yet passed on, and the bytes waiting to be written to it."""
        if sock is self.outer:
            return self.inner, self.to_inner, self.to_outer
        return self.outer, self.to_outer, self.to_inner


class FrontDoor:
    """Serves the public socket at `path` (file mode `mode`) from a background thread, relaying
    to the gRPC server listening at `inner` (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        inner: Path,
        mode: int,
        *,
        places: int,
        waiting: int,
        reserved: int,
        handshake_s: float,
        quiet_s: float,
    ) -> None:
        if not 0 <= reserved < places or waiting < 1 or not handshake_s > 0:
            raise ValueError(
                f"need 0 <= reserved < places, waiting >= 1 and handshake_s > 0; got"
                f" places={places} waiting={waiting} reserved={reserved} handshake_s={handshake_s}"
            )
        self.path, self.inner = path, inner
        self.places, self.waiting, self.reserved = places, waiting, reserved
        self.handshake_s, self.quiet_s = handshake_s, quiet_s
        self._refused_total = 0  # connections closed for want of a place or a preface, in all
        self._log_at, self._logged = 0.0, 0  # when the next warning may be; refused by then
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, mode)
        self._sock.listen(socket.SOMAXCONN)
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._waiting: dict[socket.socket, _Waiting] = {}  # in order of arrival: of deadline too
        self._by_uid: Counter[int] = Counter()  # waiting connections of each uid
        self._by_process: dict[tuple[int, int], dict[socket.socket, None]] = {}  # (uid, pid):
        # its waiting connections, oldest first
        self._pairs: dict[socket.socket, _Pair] = {}  # by either of its sockets
        self._interest: dict[socket.socket, int] = {}  # a pair's sockets: the events watched
        self._buffer = bytearray(READ_BYTES)  # every read lands here first: no allocation
        self._view = memoryview(self._buffer)
        self._held: Counter[int] = Counter()  # places by uid
        self._relayed = 0  # places held, all uids
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="front", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def counts(self) -> dict[str, int]:
        """Connections waiting for their preface and relayed now, and refused in all (read
        from any thread: a moment's figures)."""
        return {
            "waiting": len(self._waiting),
            "relayed": self._relayed,
            "refused": self._refused_total,
        }

    def close(self) -> None:
        """Stop accepting, close every connection, remove the socket."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        for sock in [*self._waiting, *self._pairs, self._sock, self._wake_r, self._wake_w]:
            sock.close()
        self._selector.close()
        self.path.unlink(missing_ok=True)

    # -- the selector thread --------------------------------------------------------------------
    def _loop(self) -> None:
        """Until close(): an unexpected error is logged, and the loop goes on after a pause."""
        while not self._closing.is_set():
            try:
                self._step()
            except Exception:
                log.exception("front.loop_failed")
                self._closing.wait(0.1)

    def _step(self) -> None:
        now = time.monotonic()
        while self._waiting:  # in order of deadline
            first = next(iter(self._waiting.values()))
            if first.deadline > now:
                break
            self._refuse(first.sock, f"no HTTP/2 preface within {self.handshake_s:g} s")
        timeout = (
            max(0.0, next(iter(self._waiting.values())).deadline - now) if self._waiting else None
        )
        for key, events in self._selector.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is self._sock:
                self._accept()
            elif sock is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(64)
            elif sock in self._waiting:
                self._greet(self._waiting[sock])
            elif sock in self._pairs:  # not closed by an earlier event of this round
                self._relay(self._pairs[sock], sock, events)

    def _accept(self) -> None:
        """Accept what waits, a few rooms' worth at most: a flood of connections never keeps
        the loop from reading the others. With the room full, the process that holds the most
        of it (of the uid holding the most) loses a connection: the newcomer itself when it is
        theirs (three system calls: a flood costs the loop as little as it can), else their
        oldest."""
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                sock, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as e:  # out of fds: what waits stays in the backlog a moment
                log.warning("front.accept_failed", extra={"why": e.strerror})
                self._closing.wait(0.01)
                return
            try:
                peer = peer_of(sock)
            except OSError:
                sock.close()
                continue
            if len(self._waiting) >= self.waiting:
                why = f"{self.waiting} connections wait for their preface"
                heaviest = self._heaviest(peer)
                if heaviest == (peer.uid, peer.pid):
                    self._refused(peer, why)
                    sock.close()
                    continue
                self._refuse(next(iter(self._by_process[heaviest])), why)
            sock.setblocking(False)
            self._waiting[sock] = _Waiting(sock, peer, time.monotonic() + self.handshake_s)
            self._by_uid[peer.uid] += 1
            self._by_process.setdefault((peer.uid, peer.pid), {})[sock] = None
            self._selector.register(sock, selectors.EVENT_READ, None)

    def _heaviest(self, newcomer: Peer) -> tuple[int, int]:
        """The (uid, pid) holding the most of the waiting room, of the uid holding the most,
        `newcomer` counted among them (a tie goes against those already there)."""
        uids = [*self._by_uid, newcomer.uid]
        uid = max(uids, key=lambda u: self._by_uid[u] + (u == newcomer.uid))
        mine = (newcomer.uid, newcomer.pid)
        processes = [*(k for k in self._by_process if k[0] == uid), mine]
        return max(processes, key=lambda k: len(self._by_process.get(k, ())) + (k == mine))

    def _leave(self, sock: socket.socket) -> Peer:
        """Take a connection out of the waiting room (refused, or relayed): its peer."""
        peer = self._waiting.pop(sock).peer
        self._by_uid[peer.uid] -= 1
        if not self._by_uid[peer.uid]:
            del self._by_uid[peer.uid]
        process = self._by_process[peer.uid, peer.pid]
        del process[sock]
        if not process:
            del self._by_process[peer.uid, peer.pid]
        self._selector.unregister(sock)
        return peer

    def _refuse(self, sock: socket.socket, why: str) -> None:
        """Close a waiting connection (`why` "": it went away itself)."""
        peer = self._leave(sock)
        if why:
            self._refused(peer, why)  # counted before the peer can see it closed
        sock.close()

    def _refused(self, peer: Peer, why: str) -> None:
        """Count a connection refused; a warning says why, at most one every LOG_EVERY_S (with
        how many since the last): a flood writes a few lines, not one a connection."""
        self._refused_total += 1
        now = time.monotonic()
        if now >= self._log_at:
            extra = {"uid": peer.uid, "pid": peer.pid, "why": why}
            log.warning(
                "front.refused", extra={**extra, "refused": self._refused_total - self._logged}
            )
            self._log_at, self._logged = now + LOG_EVERY_S, self._refused_total

    def _greet(self, waiting: _Waiting) -> None:
        """Read the preface; once whole (and right), relay the connection if its uid has a place."""
        try:
            data = waiting.sock.recv(len(PREFACE) - len(waiting.data))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        waiting.data += data
        if not data or not PREFACE.startswith(waiting.data):
            self._refuse(waiting.sock, "not HTTP/2" if data else "")  # or gone: no word
            return
        if len(waiting.data) < len(PREFACE):
            return
        uid = waiting.peer.uid
        if self._relayed >= self.places and not self._take_quiet_place(uid):
            self._refuse(waiting.sock, f"all {self.places} places are held")
            return
        if self._held[uid] >= self.places - self.reserved:
            held = self._held[uid]
            self._refuse(waiting.sock, f"its uid holds {held} places, all but {self.reserved}")
            return
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        inner.setblocking(False)
        try:
            inner.connect(str(self.inner))
        except OSError as e:  # the gRPC server's backlog is full, or it is stopping
            inner.close()
            self._refuse(waiting.sock, f"the gRPC server's socket refused it: {e.strerror}")
            return
        self._leave(waiting.sock)
        pair = _Pair(waiting.sock, inner, uid, time.monotonic(), to_inner=bytearray(PREFACE))
        self._pairs[pair.outer] = self._pairs[inner] = pair
        self._held[uid] += 1
        self._relayed += 1
        self._watch(pair, pair.outer)
        self._watch(pair, inner)

    def _take_quiet_place(self, uid: int) -> bool:
        """With every place held: close the connection quiet longest of the uid holding the
        most, when `uid` holds fewer than that uid less one and it has been quiet `quiet_s`;
        whether a place is free now."""
        heaviest = max(self._held, key=lambda u: self._held[u])
        if self._held[uid] >= self._held[heaviest] - 1:
            return False
        theirs = {id(p): p for p in self._pairs.values() if p.uid == heaviest}.values()
        quietest = min(theirs, key=lambda p: p.last)
        quiet_for = time.monotonic() - quietest.last
        if quiet_for < self.quiet_s:
            return False
        self._refused_total += 1
        extra = {"uid": heaviest, "quiet_s": round(quiet_for, 1), "for_uid": uid}
        log.info("front.place_taken", extra=extra)
        self._end(quietest)
        return True

    def _relay(self, pair: _Pair, sock: socket.socket, events: int) -> None:
        other, incoming, outgoing = pair.sides(sock)
        try:
            if events & selectors.EVENT_WRITE and outgoing:
                del outgoing[: sock.send(outgoing)]
                if not outgoing and other in pair.ended:
                    sock.shutdown(socket.SHUT_WR)
            if events & selectors.EVENT_READ and not incoming:
                n = sock.recv_into(self._buffer)
                if n:
                    pair.last = time.monotonic()
                    incoming += self._view[:n]
                    with contextlib.suppress(BlockingIOError):
                        del incoming[: other.send(incoming)]
                else:
                    pair.ended.add(sock)
                    if not incoming:
                        other.shutdown(socket.SHUT_WR)
        except BlockingIOError:
            pass
        except OSError:  # reset, or a broken pipe: the connection is over both ways
            self._end(pair)
            return
        if len(pair.ended) == 2 and not pair.to_inner and not pair.to_outer:
            self._end(pair)
            return
        for side in (pair.outer, pair.inner):
            self._watch(pair, side)

    def _watch(self, pair: _Pair, sock: socket.socket) -> None:
        """Read from a side while what it sent last is passed on and it has not ended; write to
        it while bytes for it wait."""
        _, from_it, to_it = pair.sides(sock)
        events = (0 if from_it or sock in pair.ended else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if to_it else 0
        )
        was = self._interest.get(sock, 0)
        if events == was:
            return
        if events and was:
            self._selector.modify(sock, events, None)
        elif events:
            self._selector.register(sock, events, None)
        else:
            self._selector.unregister(sock)
        self._interest[sock] = events

    def _end(self, pair: _Pair) -> None:
        for sock in (pair.outer, pair.inner):
            if self._interest.pop(sock, 0):
                self._selector.unregister(sock)
            del self._pairs[sock]
            sock.close()
        self._held[pair.uid] -= 1
        self._relayed -= 1
        if not self._held[pair.uid]:
            del self._held[pair.uid]
