"""Fuzzing every entry point of a real daemon while a bystander session holds known bytes.

    unary RPCs (Pool, Admin, Health) ──mutated bytes, forged tokens──▶ ┐
    Session streams ──valid token, mutated ClientMessages────────────▶ ├─▶ tidalpoold ─▶ codes
    handles.sock ──mutated frames, wrong lengths, stray fds───────────▶ ┘       │
                                                       bystander ◀── bytes intact, still serving

Every message starts from a valid request of its kind and is mutated (bits flipped, cut,
spliced, varints and lengths pushed to their extremes). Each answer is judged against the
codes its RPC may answer (`ALLOWED`), narrowed where the request parses; never INTERNAL, never
UNKNOWN. After each batch the daemon is alive, answers PoolStatus, ListSessions and Health, and
the bystander's bytes are intact; at the end every lease is back (leased 0, free == total on
both pools) and the daemon's RSS and open fds are back within `RSS_SLACK` and `FD_SLACK` of
what they were before the fuzzing.

The seed is printed (shown on failure) and taken from $TIDALPOOL_FUZZ_SEED when set. The fuzz
kit here (mutators, raw calls, raw streams, raw handles exchanges) is also what `bench/soak.py`
runs for its long version.
"""

from __future__ import annotations

import math
import os
import queue
import random
import secrets
import socket
import string
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tidalpool
from google.protobuf.message import DecodeError, Message
from grpc import StatusCode as Code
from grpc_health.v1 import health_pb2
from tidalclient.local import LocalDaemon
from tidalcore import framing
from tidalcore.v1 import admin_pb2, common_pb2, handles_pb2, pool_pb2
from tidalcore.wire import (
    ADMIN_SOCKET,
    GRPC_SOCKET,
    HANDLES_SOCKET,
    HANDLES_VERSION,
    STREAM_OPEN_KEY,
    TOKEN_KEY,
)

from ..conftest import StartDaemon

KiB, MiB = 1 << 10, 1 << 20
U64_MAX = (1 << 64) - 1
SEED_ENV = "TIDALPOOL_FUZZ_SEED"
CALL_TIMEOUT_S = 20.0  # a busy 2-core machine answers in milliseconds; this is "never"
HANDLES_TIMEOUT_S = 10.0
RSS_SLACK = 64 * MiB
"""How much the daemon's RSS may grow over a fuzz run, once every session has ended: nothing a
peer sent is kept after its session, so what remains is allocator slack and gRPC's per-thread
buffers (its pool grows to max_sessions + 16 threads). A leak of a trace or of one message per
call over a run (thousands of calls) shows up well past it."""
FD_SLACK = 8
"""Open fds the daemon may hold beyond its count before the run once every peer is gone: the
chunks' fds are constant (a renewed chunk's new fd replaces the old one), a connection's fd is
closed with it; a few are gRPC's (pollers, wakeup fds it makes lazily). A stray fd a peer sent
that was kept, or a connection never closed, accumulates past it."""

POOL_SERVICE, ADMIN_SERVICE = "tidalpool.v1.Pool", "tidalpool.v1.Admin"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SESSION_METHOD = f"/{POOL_SERVICE}/Session"
SERVING_NAMES = ("", POOL_SERVICE, ADMIN_SERVICE)

STREAM_CODES = frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"})
"""Codes a SessionError on the stream may carry: a refused message, and the session goes on."""
HANDLES_CODES = frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED"})
"""Codes a HandlesResponse may carry."""


# -- where the daemon listens ---------------------------------------------------------------
def admin_channel(socket_dir: Path) -> grpc.Channel:
    """A channel to the Admin service: admin.sock where the daemon has one, else the gRPC
    socket it shares with the Pool service."""
    admin = socket_dir / ADMIN_SOCKET
    path = admin if admin.exists() else socket_dir / GRPC_SOCKET
    return grpc.insecure_channel(f"unix:{path}")


def pool_channel(socket_dir: Path) -> grpc.Channel:
    """A channel to the Pool and Health services (tidalpool.sock)."""
    return grpc.insecure_channel(f"unix:{socket_dir / GRPC_SOCKET}")


def daemon_rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KiB
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


def daemon_open_fds(pid: int) -> int:
    """How many fds the process holds (needs the rights to read /proc/PID/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


# -- raw calls ---------------------------------------------------------------------------------
Metadata = tuple[tuple[str, str | bytes], ...]


def call_raw(
    channel: grpc.Channel, method: str, body: bytes, metadata: Metadata = ()
) -> tuple[Code, bytes | str]:
    """One unary call with the request as raw bytes: (OK, reply bytes) or (code, details)."""
    fn = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        reply: bytes = fn(body, metadata=metadata, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        return e.code(), str(e.details())
    return Code.OK, reply


def token_metadata(token: str) -> Metadata:
    return ((TOKEN_KEY, token),)


@dataclass
class RawSession:
    """A session opened on the handles socket by hand (its fds closed at once)."""

    id: str
    token: str
    attached: bool = False
    ended: bool = False


@dataclass(frozen=True)
class HandlesReply:
    """What came back from one exchange on the handles socket: "granted" (and how many fds
    followed), an error code name, "closed" (the daemon hung up before a whole reply) or
    "hung" (no answer in time); the response where one came."""

    outcome: str
    response: handles_pb2.HandlesResponse | None = None
    fds: int = 0


def handles_exchange(
    path: Path,
    payload: bytes,
    fds: Sequence[int] = (),
    timeout: float = HANDLES_TIMEOUT_S,
) -> HandlesReply:
    """Send `payload` (with `fds` attached) on a new handles connection, close the writing
    half, and read what comes back; granted fds are received and closed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    with sock:
        sock.connect(str(path))
        try:
            if fds and payload:
                sent = socket.send_fds(sock, [payload], list(fds))
                sock.sendall(payload[sent:])
            elif payload:
                sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            response, stray = framing.receive(sock, handles_pb2.HandlesResponse)
        except TimeoutError:
            return HandlesReply("hung")
        except (OSError, framing.FramingError):
            return HandlesReply("closed")  # reset, or closed before a whole response
        for fd in stray:
            os.close(fd)
        if response.error_code:
            return HandlesReply(response.error_code, response)
        try:
            granted = framing.receive_fds(sock, response.fd_count)
        except TimeoutError:
            return HandlesReply("hung", response)
        except (OSError, framing.FramingError):
            return HandlesReply("closed", response)
        for fd in granted:
            os.close(fd)
        return HandlesReply("granted", response, len(granted))


def frame(body: bytes) -> bytes:
    """`body` framed as the handles socket frames it (u32 little-endian length first)."""
    return struct.pack("<I", len(body)) + body


def open_raw_session(
    socket_dir: Path, device_bytes: int = 2 * MiB, host_bytes: int = 2 * MiB, job: str = "fuzz"
) -> RawSession:
    """A pending session from a well-formed handles request; AssertionError if refused."""
    request = handles_pb2.HandlesRequest(
        version=HANDLES_VERSION, device_bytes=device_bytes, host_bytes=host_bytes, job_name=job
    )
    reply = handles_exchange(socket_dir / HANDLES_SOCKET, frame(request.SerializeToString()))
    assert reply.outcome == "granted" and reply.response is not None, (
        f"a well-formed handles request got {reply.outcome}"
        + (f": {reply.response.error_message}" if reply.response is not None else "")
    )
    return RawSession(reply.response.session_id, reply.response.token)


def attach_raw(channel: grpc.Channel, session: RawSession) -> None:
    code, details = call_raw(
        channel,
        f"/{POOL_SERVICE}/Attach",
        pool_pb2.AttachRequest(client_version="fuzz", pid=os.getpid()).SerializeToString(),
        token_metadata(session.token),
    )
    assert code == Code.OK, f"Attach of {session.id} with its own token: {code.name} {details!r}"
    session.attached = True


def detach_raw(channel: grpc.Channel, session: RawSession) -> Code:
    """End a raw session (UNAUTHENTICATED: it had already ended)."""
    code, _ = call_raw(channel, f"/{POOL_SERVICE}/Detach", b"", token_metadata(session.token))
    session.ended = True
    return code


class RawStream:
    """A Session stream spoken in raw bytes, as a broken or hostile client would: what is sent
    is queued, what comes back is collected by a reader thread."""

    def __init__(self, channel: grpc.Channel, metadata: Metadata, timeout: float = 120) -> None:
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        call = channel.stream_stream(
            SESSION_METHOD, request_serializer=None, response_deserializer=None
        )
        self._responses: Any = call(self._outgoing(), metadata=metadata, timeout=timeout)
        self.received: list[pool_pb2.ServerMessage] = []
        self.code: Code | None = None  # the stream's final status, once it ended
        self.details = ""
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="fuzz-stream", daemon=True)
        self._reader.start()

    def opened(self) -> bool:
        """True once the daemon made the stream the session's (waits for its headers)."""
        return (STREAM_OPEN_KEY, "1") in tuple(self._responses.initial_metadata() or ())

    def send(self, raw: bytes) -> None:
        self._out.put(raw)

    def errors(self) -> list[pool_pb2.SessionError]:
        return [m.error for m in list(self.received) if m.WhichOneof("body") == "error"]

    def wait_for_error(
        self, needle: str, timeout: float = 30.0, nudge: tuple[bytes, ...] = ()
    ) -> None:
        """Wait until a SessionError whose message holds `needle` arrived; with `nudge`, send
        those messages again each second meanwhile."""

        def done() -> bool:
            return any(needle in e.message for e in self.errors()) or self.code is not None

        deadline = time.monotonic() + timeout
        while nudge and not done() and time.monotonic() < deadline:
            for raw in nudge:
                self.send(raw)
            second = time.monotonic() + 1.0
            while not done() and time.monotonic() < second:
                time.sleep(0.02)
        wait_for(done, f"a SessionError naming {needle!r}", max(0.0, deadline - time.monotonic()))
        assert any(needle in e.message for e in self.errors()), (
            f"the stream ended ({self.code}: {self.details}) before refusing the message"
            f" naming {needle!r}; received {list(self.received)}"
        )

    def close(self) -> list[pool_pb2.ServerMessage]:
        """End the client's half and wait for the daemon's (its goodbye)."""
        if not self._closed:
            self._closed = True
            self._out.put(None)
        self._reader.join(timeout=60)
        assert not self._reader.is_alive(), "the daemon did not end a stream whose client closed"
        return list(self.received)

    def cancel(self) -> None:
        self._closed = True
        self._out.put(None)
        self._responses.cancel()
        self._reader.join(timeout=60)

    def _outgoing(self) -> Iterator[bytes]:
        while True:
            raw = self._out.get()
            if raw is None:
                return
            yield raw

    def _read(self) -> None:
        try:
            for raw in self._responses:
                self.received.append(pool_pb2.ServerMessage.FromString(raw))
            self.code, self.details = self._responses.code(), str(self._responses.details())
        except grpc.RpcError as e:
            self.code, self.details = e.code(), str(e.details())
        finally:
            if not self._closed:  # the daemon ended it: let the request thread go too
                self._out.put(None)


# -- mutation ----------------------------------------------------------------------------------
_INTERESTING = (
    b"\xff" * 10,  # a varint that never ends
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # 2**64 - 1
    b"\x80",  # a varint cut short
    b"\x0a\xff\xff\xff\xff\x0f",  # field 1, length-delimited, 4 GiB long
    b"\x0a\x7f",  # field 1, 127 bytes promised
    b"\x0f",  # field 1, wire type 7 (invalid)
    b"\x0e",  # field 1, wire type 6 (invalid)
    b"\x00",  # field 0 (invalid)
    b"\x0b",  # a group start never closed
    b"\x12\x02\xc3\x28",  # field 2, bytes that are not UTF-8
)


def mutate(rng: random.Random, seed: bytes, others: Sequence[bytes] = ()) -> bytes:
    """`seed` with one to three mutations: bits flipped, cut, bytes inserted or deleted,
    spliced with another message, an "interesting" run written in, or replaced by noise."""
    data = bytearray(seed)
    for _ in range(rng.randint(1, 3)):
        how = rng.randrange(8)
        if how == 0 and data:  # flip bits
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
        elif how == 1 and data:  # cut
            del data[rng.randrange(len(data)) :]
        elif how == 2:  # insert noise
            i = rng.randint(0, len(data))
            data[i:i] = rng.randbytes(rng.randint(1, 16))
        elif how == 3 and data:  # delete a run
            i = rng.randrange(len(data))
            del data[i : i + rng.randint(1, 8)]
        elif how == 4:  # splice with another message (or itself)
            other = rng.choice(others) if others else bytes(data)
            i, j = rng.randint(0, len(data)), rng.randint(0, len(other))
            data = data[:i] + bytearray(other[j:])
        elif how == 5:  # write an interesting run in
            i = rng.randint(0, len(data))
            data[i:i] = rng.choice(_INTERESTING)
        elif how == 6:  # repeat the message (repeated fields grow, singular ones are redefined)
            data = data * rng.randint(2, 8)
        else:  # noise of its own
            data = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(data)


def parses(kind: type[Message], body: bytes) -> Message | None:
    """`body` as a `kind`, or None where protobuf refuses it (as the daemon's parser would)."""
    try:
        return kind.FromString(body)
    except (DecodeError, RuntimeError, ValueError):
        return None


def forged_token(rng: random.Random, live: Sequence[str], dead: Sequence[str]) -> Metadata:
    """Metadata with no valid token: none, noise, long, one character off a live token, an
    ended session's, two of them, empty, or binary."""
    printable = string.ascii_letters + string.digits + "-_.~+/="
    how = rng.randrange(8)
    if how == 0:
        return ()
    if how == 1:
        return ((TOKEN_KEY, "".join(rng.choices(printable, k=rng.randint(1, 64)))),)
    if how == 2:
        return ((TOKEN_KEY, "A" * rng.randint(1000, 6000)),)
    if how == 3 and live:
        token = rng.choice(live)
        i = rng.randrange(len(token))
        other = rng.choice([c for c in printable if c != token[i]])
        return ((TOKEN_KEY, token[:i] + other + token[i + 1 :]),)
    if how == 4 and dead:
        return ((TOKEN_KEY, rng.choice(dead)),)
    if how == 5 and live:
        return ((TOKEN_KEY, rng.choice(live)), (TOKEN_KEY, "forged"))
    if how == 6:
        return ((TOKEN_KEY, ""),)
    return ((TOKEN_KEY + "-bin", rng.randbytes(rng.randint(1, 48))),)


# -- the unary RPCs and what each may answer ----------------------------------------------------
@dataclass(frozen=True)
class Rpc:
    """A unary RPC under fuzz: its path, request type, valid requests to mutate, the codes it
    may answer at all, and whether it is the Pool's (a session token in its metadata)."""

    method: str
    request: type[Message]
    response: type[Message]
    seeds: tuple[bytes, ...]
    allowed: frozenset[Code]
    needs_token: bool = False
    admin: bool = False


def _ser(*messages: Message) -> tuple[bytes, ...]:
    return tuple(m.SerializeToString() for m in messages)


_EXTREME_BEAT = pool_pb2.Heartbeat(
    **{f.name: U64_MAX for f in pool_pb2.Heartbeat.DESCRIPTOR.fields}
)
_BEAT = pool_pb2.Heartbeat(
    device_used_bytes=MiB, device_peak_bytes=2 * MiB, plan_misses=3, swapped_out_bytes=4 * KiB
)

UNARY: dict[str, Rpc] = {
    rpc.method: rpc
    for rpc in (
        Rpc(
            f"/{POOL_SERVICE}/Attach",
            pool_pb2.AttachRequest,
            pool_pb2.AttachResponse,
            _ser(
                pool_pb2.AttachRequest(client_version="0.1.0", pid=4242),
                pool_pb2.AttachRequest(swap_limit_bytes=8 * MiB, copy_gbps=3.0),
                pool_pb2.AttachRequest(copy_gbps=1e300, swap_limit_bytes=U64_MAX),
            ),
            frozenset(
                {Code.OK, Code.INVALID_ARGUMENT, Code.UNAUTHENTICATED, Code.FAILED_PRECONDITION}
            ),
            needs_token=True,
        ),
        Rpc(
            f"/{POOL_SERVICE}/Detach",
            pool_pb2.DetachRequest,
            pool_pb2.DetachResponse,
            _ser(
                pool_pb2.DetachRequest(),
                pool_pb2.DetachRequest(last=_BEAT),
                pool_pb2.DetachRequest(last=_EXTREME_BEAT),
            ),
            frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.UNAUTHENTICATED}),
            needs_token=True,
        ),
        Rpc(
            f"/{POOL_SERVICE}/Stats",
            pool_pb2.StatsRequest,
            pool_pb2.StatsResponse,
            (b"",),
            frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.UNAUTHENTICATED}),
            needs_token=True,
        ),
        Rpc(
            f"/{ADMIN_SERVICE}/ListSessions",
            admin_pb2.ListSessionsRequest,
            admin_pb2.ListSessionsResponse,
            (b"",),
            frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.PERMISSION_DENIED}),
            admin=True,
        ),
        Rpc(
            f"/{ADMIN_SERVICE}/EvictSession",
            admin_pb2.EvictSessionRequest,
            admin_pb2.EvictSessionResponse,
            _ser(
                admin_pb2.EvictSessionRequest(session_id="s-000000000000", reason="fuzz"),
                admin_pb2.EvictSessionRequest(session_id="s-" + "f" * 12),
                admin_pb2.EvictSessionRequest(reason="no id"),
            ),
            frozenset({Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.PERMISSION_DENIED}),
            admin=True,
        ),
        Rpc(
            f"/{ADMIN_SERVICE}/PoolStatus",
            admin_pb2.PoolStatusRequest,
            admin_pb2.PoolStatusResponse,
            (b"",),
            frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.PERMISSION_DENIED}),
            admin=True,
        ),
        Rpc(
            HEALTH_CHECK,
            health_pb2.HealthCheckRequest,
            health_pb2.HealthCheckResponse,
            _ser(*(health_pb2.HealthCheckRequest(service=name) for name in SERVING_NAMES)),
            frozenset({Code.OK, Code.NOT_FOUND, Code.INVALID_ARGUMENT}),
        ),
    )
}
"""Every unary RPC of the daemon, and the codes each may answer a hostile or broken caller."""


@dataclass(frozen=True)
class Outcome:
    """One message's fate: its target, the code (or handles outcome) it got, whether that is
    one the target may answer it, and enough to replay it."""

    target: str
    code: str
    expected: bool
    what: str


def _describe(body: bytes, metadata: Metadata = ()) -> str:
    shown = body[:48].hex() + ("..." if len(body) > 48 else "")
    keys = [k for k, _ in metadata]
    return f"body {len(body)} bytes {shown}, metadata keys {keys}"


def _expected_unary(
    rpc: Rpc,
    request: Message | None,
    raw: RawSession | None,
    live_ids: set[str],
) -> frozenset[Code]:
    """The codes `rpc` may answer this request: a subset of `rpc.allowed`, narrowed where the
    request parses and the token's state is known."""
    if request is None:  # malformed; a forged token may be judged first
        return frozenset({Code.INVALID_ARGUMENT}) | (
            frozenset({Code.UNAUTHENTICATED}) if rpc.needs_token else frozenset()
        )
    if rpc.needs_token and (raw is None or raw.ended):
        return frozenset({Code.UNAUTHENTICATED})
    if isinstance(request, pool_pb2.AttachRequest):
        gbps = request.copy_gbps
        if not math.isfinite(gbps) or gbps < 0:
            return frozenset({Code.INVALID_ARGUMENT})
        assert raw is not None  # a value it cannot mean (a swap limit past its lease) is refused
        return frozenset({Code.FAILED_PRECONDITION if raw.attached else Code.OK}) | {
            Code.INVALID_ARGUMENT
        }
    if isinstance(request, pool_pb2.DetachRequest):  # its last heartbeat is checked first
        return frozenset({Code.OK, Code.INVALID_ARGUMENT})
    if isinstance(request, admin_pb2.EvictSessionRequest):
        if not request.session_id:
            return frozenset({Code.INVALID_ARGUMENT})
        assert request.session_id not in live_ids  # never evict what the fuzz does not own
        return frozenset({Code.NOT_FOUND, Code.INVALID_ARGUMENT})
    if isinstance(request, health_pb2.HealthCheckRequest):  # Admin's may be on admin.sock only
        if request.service == ADMIN_SERVICE:
            return frozenset({Code.OK, Code.NOT_FOUND})
        return frozenset({Code.OK if request.service in SERVING_NAMES else Code.NOT_FOUND})
    return frozenset({Code.OK, Code.INVALID_ARGUMENT}) if rpc.admin else frozenset({Code.OK})


class Target:
    """The daemon under fuzz: its socket directory and a channel to each of its services."""

    def __init__(self, socket_dir: Path) -> None:
        self.socket_dir = socket_dir
        self._stack = ExitStack()
        self.pool = self._stack.enter_context(pool_channel(socket_dir))
        self.admin = self._stack.enter_context(admin_channel(socket_dir))
        self.dead_tokens: list[str] = []
        self.sent = 0  # fuzzed messages sent, every kind

    def close(self) -> None:
        self._stack.close()

    def channel_of(self, rpc: Rpc) -> grpc.Channel:
        return self.admin if rpc.admin else self.pool

    def pool_status(self) -> admin_pb2.PoolStatusResponse:
        code, reply = call_raw(self.admin, f"/{ADMIN_SERVICE}/PoolStatus", b"")
        assert code == Code.OK and isinstance(reply, bytes), f"PoolStatus: {code.name} {reply!r}"
        return admin_pb2.PoolStatusResponse.FromString(reply)

    def session_infos(self) -> list[common_pb2.SessionInfo]:
        code, reply = call_raw(self.admin, f"/{ADMIN_SERVICE}/ListSessions", b"")
        assert code == Code.OK and isinstance(reply, bytes), f"ListSessions: {code.name} {reply!r}"
        return list(admin_pb2.ListSessionsResponse.FromString(reply).sessions)

    def sessions(self) -> list[str]:
        return [s.session_id for s in self.session_infos()]

    def serving(self) -> bool:
        code, reply = call_raw(self.pool, HEALTH_CHECK, b"")
        if code != Code.OK or not isinstance(reply, bytes):
            return False
        status = health_pb2.HealthCheckResponse.FromString(reply).status
        return bool(status == health_pb2.HealthCheckResponse.SERVING)

    def evict_pending(self) -> None:
        """Evict the sessions still pending: granted to a peer that hung up before it read its
        reply (the daemon would reclaim them after attach_timeout_s). Attached sessions are
        left alone: each must end by itself."""
        for info in self.session_infos():
            if info.state == "pending":
                request = admin_pb2.EvictSessionRequest(session_id=info.session_id, reason="fuzz")
                code, _ = call_raw(
                    self.admin, f"/{ADMIN_SERVICE}/EvictSession", request.SerializeToString()
                )
                assert code in (Code.OK, Code.NOT_FOUND), f"evicting {info.session_id}: {code}"

    def raw_session(self, attach: bool = False) -> RawSession:
        session = open_raw_session(self.socket_dir)
        if attach:
            attach_raw(self.pool, session)
        return session

    def end(self, sessions: Sequence[RawSession]) -> None:
        for s in sessions:
            if not s.ended:
                detach_raw(self.pool, s)
            self.dead_tokens.append(s.token)

    # -- fuzzing -------------------------------------------------------------------------------
    def fuzz_unary(self, rpc: Rpc, rng: random.Random, count: int) -> list[Outcome]:
        """`count` mutated requests to `rpc`; the Pool's get a live token half of the time (of
        sessions opened for them, ended afterwards) and a forged one otherwise."""
        owned = [self.raw_session() for _ in range(3)] if rpc.needs_token else []
        live_ids = set(self.sessions()) if rpc.method.endswith("EvictSession") else set()
        outcomes = []
        try:
            for _ in range(count):
                body = mutate(rng, rng.choice(rpc.seeds), rpc.seeds)
                if rng.random() < 0.15:
                    body = rng.choice(rpc.seeds)  # valid ones too: the state they change is fuzzed
                request = parses(rpc.request, body)
                if isinstance(request, admin_pb2.EvictSessionRequest) and (
                    request.session_id in live_ids
                ):
                    continue
                raw: RawSession | None = None
                metadata: Metadata = ()
                live = [s.token for s in owned if not s.ended]
                if rpc.needs_token and live and rng.random() < 0.5:
                    raw = rng.choice([s for s in owned if not s.ended])
                    metadata = token_metadata(raw.token)
                elif rpc.needs_token:
                    metadata = forged_token(rng, live, self.dead_tokens)
                expected = _expected_unary(rpc, request, raw, live_ids)
                code, reply = call_raw(self.channel_of(rpc), rpc.method, body, metadata)
                self.sent += 1
                ok = code in expected and code in rpc.allowed
                if code == Code.OK:
                    ok = ok and isinstance(reply, bytes) and parses(rpc.response, reply) is not None
                    if raw is not None and rpc.method.endswith("/Attach"):
                        raw.attached = True
                    if raw is not None and rpc.method.endswith("/Detach"):
                        raw.ended = True
                outcomes.append(
                    Outcome(
                        rpc.method,
                        code.name,
                        ok,
                        f"{_describe(body, metadata)} expected {sorted(c.name for c in expected)}"
                        f" got {code.name}: {str(reply)[:200]}",
                    )
                )
        finally:
            self.end(owned)
        return outcomes

    def fuzz_stream(self, rng: random.Random, count: int) -> list[Outcome]:
        """One session's stream fed `count` mutated ClientMessages with its valid token, checked
        while it is open (PoolStatus, ListSessions and Stats answer; the refusals carry their
        codes), then closed: the daemon ends it with the goodbye of a client that closed. A
        forged token and a second stream for the same session are refused too."""
        outcomes = []
        session = self.raw_session(attach=True)
        try:
            stream = RawStream(self.pool, token_metadata(session.token))
            assert stream.opened(), f"the stream of {session.id}: {stream.code} {stream.details}"
            for _ in range(count):
                seed = rng.choice(STREAM_SEEDS)
                stream.send(seed if rng.random() < 0.15 else mutate(rng, seed, STREAM_SEEDS))
                self.sent += 1
            stream.send(STREAM_SENTINEL)
            stream.wait_for_error(str(U64_MAX))
            outcomes += self._stream_neighbours(rng, session)
            for rpc_check in (self.pool_status, self.sessions):
                rpc_check()
            code, reply = call_raw(
                self.pool, f"/{POOL_SERVICE}/Stats", b"", token_metadata(session.token)
            )
            outcomes.append(
                Outcome("Stats during the stream", code.name, code == Code.OK, str(reply)[:200])
            )
            received = stream.close()
            session.ended = True
        finally:
            self.end([session])
        for m in received:
            body = m.WhichOneof("body")
            if body == "error":
                outcomes.append(
                    Outcome(
                        SESSION_METHOD,
                        m.error.code,
                        m.error.code in STREAM_CODES,
                        f"SessionError {m.error.code}: {m.error.message[:200]}",
                    )
                )
        last = received[-1] if received else None
        goodbye_ok = (
            last is not None
            and last.WhichOneof("body") == "goodbye"
            and last.goodbye.reason == pool_pb2.Goodbye.REASON_DETACHED
            and last.goodbye.message == "client closed its session stream"
            and stream.code == Code.OK
        )
        outcomes.append(
            Outcome(
                "Session end",
                "goodbye" if goodbye_ok else "other",
                goodbye_ok,
                f"the stream ended with {last} ({stream.code}: {stream.details})",
            )
        )
        return outcomes

    def _stream_neighbours(self, rng: random.Random, session: RawSession) -> list[Outcome]:
        """A forged token's stream is UNAUTHENTICATED; a second stream of a session that has
        one is FAILED_PRECONDITION."""
        outcomes = []
        for metadata, code in (
            (forged_token(rng, [session.token], self.dead_tokens), Code.UNAUTHENTICATED),
            (token_metadata(session.token), Code.FAILED_PRECONDITION),
        ):
            other = RawStream(self.pool, metadata)
            other.close()
            outcomes.append(
                Outcome(
                    SESSION_METHOD,
                    other.code.name if other.code is not None else "none",
                    other.code == code,
                    f"a second or forged stream ({[k for k, _ in metadata]}) expected"
                    f" {code.name}, got {other.code}: {other.details}",
                )
            )
        return outcomes

    def fuzz_handles(self, rng: random.Random, count: int) -> list[Outcome]:
        """`count` exchanges on the handles socket: mutated requests, noise, wrong and huge
        length prefixes, frames cut short, fds attached. Granted sessions are detached."""
        path = self.socket_dir / HANDLES_SOCKET
        outcomes = []
        for _ in range(count):
            payload, expected, attach_fds = handles_payload(rng)
            fds: list[int] = []
            if attach_fds and payload:
                r, w = os.pipe()
                fds = [r, w, os.open(os.devnull, os.O_RDONLY)]
            try:
                reply = handles_exchange(path, payload, fds)
                self.sent += 1
            finally:
                for fd in fds:
                    os.close(fd)
            if fds:  # a daemon may refuse a peer that sends fds, or hang up on it
                expected = expected | {"INVALID_ARGUMENT", "closed"}
            ok = reply.outcome in expected
            if reply.outcome == "granted" and reply.response is not None:
                session = RawSession(reply.response.session_id, reply.response.token)
                code = detach_raw(self.pool, session)
                self.dead_tokens.append(session.token)
                ok = ok and code == Code.OK
            why = reply.response.error_message[:200] if reply.response is not None else ""
            outcomes.append(
                Outcome(
                    "handles",
                    reply.outcome,
                    ok,
                    f"payload {len(payload)} bytes {payload[:48].hex()} with {len(fds)} fds:"
                    f" expected {sorted(expected)}, got {reply.outcome} {why}",
                )
            )
        return outcomes


STREAM_SEEDS = _ser(
    pool_pb2.ClientMessage(heartbeat=_BEAT),
    pool_pb2.ClientMessage(heartbeat=_EXTREME_BEAT),
    pool_pb2.ClientMessage(
        trace=pool_pb2.TraceChunk(
            first_event=0,
            kinds=[pool_pb2.EVENT_KIND_ALLOC, pool_pb2.EVENT_KIND_OP, pool_pb2.EVENT_KIND_FREE],
            block_ids=[1, 0, 1],
            sizes=[4096, 0, 0],
            durations_ns=[0, 1000, 0],
            name_ids=[0, 1, 0],
            new_names={1: "matmul"},
        )
    ),
    pool_pb2.ClientMessage(step=pool_pb2.StepMark(iteration=1, events_before=0)),
    pool_pb2.ClientMessage(),
)
"""Valid ClientMessages (a heartbeat at its extremes among them) that the stream fuzz mutates."""
STREAM_SENTINEL = pool_pb2.ClientMessage(
    step=pool_pb2.StepMark(iteration=1, events_before=U64_MAX)
).SerializeToString()
"""Refused by every daemon (no session sent 2**64 - 1 events): its refusal says the daemon has
read everything sent before it."""

_HANDLES_SEEDS = _ser(
    handles_pb2.HandlesRequest(
        version=HANDLES_VERSION, device_bytes=2 * MiB, host_bytes=2 * MiB, job_name="fuzz"
    ),
    handles_pb2.HandlesRequest(version=HANDLES_VERSION, device_bytes=U64_MAX, job_name="huge"),
    handles_pb2.HandlesRequest(version=1, device_bytes=2 * MiB),
    handles_pb2.HandlesRequest(version=HANDLES_VERSION, job_name="j" * 300, host_bytes=1),
)


def handles_payload(rng: random.Random) -> tuple[bytes, frozenset[str], bool]:
    """A payload for the handles socket, the outcomes allowed for it, and whether to attach
    fds: the frame the daemon reads decides (a HandlesRequest of the supported version is
    granted or refused RESOURCE_EXHAUSTED or INVALID_ARGUMENT; another version is refused
    INVALID_ARGUMENT; anything that is not one frame of a request is refused or hung up on)."""
    body = mutate(rng, rng.choice(_HANDLES_SEEDS), _HANDLES_SEEDS)
    if rng.random() < 0.15:
        body = rng.choice(_HANDLES_SEEDS)
    how = rng.randrange(7)
    if how <= 2:
        payload = frame(body)
    elif how == 3:  # a length prefix that lies, by a little or a lot
        declared = rng.choice(
            [len(body) + rng.randint(1, 64), max(0, len(body) - rng.randint(1, 8)), U64_MAX >> 32]
        )
        payload = struct.pack("<I", declared) + body
    elif how == 4:  # a huge declared length and little behind it
        payload = struct.pack("<I", rng.randint(framing.MAX_MESSAGE + 1, U64_MAX >> 32)) + body
    elif how == 5:  # cut anywhere, the prefix included
        payload = frame(body)[: rng.randint(0, len(body) + 3)]
    else:  # noise
        payload = rng.randbytes(rng.randint(0, 256))
    attach_fds = rng.random() < 0.25
    # What the daemon reads: a u32 length, then that many bytes (at most MAX_MESSAGE).
    malformed = frozenset({"closed", "INVALID_ARGUMENT"})
    if len(payload) < 4:
        return payload, malformed, attach_fds
    (declared,) = struct.unpack("<I", payload[:4])
    if declared > framing.MAX_MESSAGE or len(payload) - 4 < declared:
        return payload, malformed, attach_fds
    request = parses(handles_pb2.HandlesRequest, payload[4 : 4 + declared])
    if not isinstance(request, handles_pb2.HandlesRequest):
        return payload, malformed, attach_fds
    if len(payload) - 4 > declared:  # bytes past the frame: read or not, never harmful
        if request.version != HANDLES_VERSION:
            return payload, frozenset({"INVALID_ARGUMENT", "closed"}), attach_fds
        return (
            payload,
            frozenset({"granted", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "closed"}),
            attach_fds,
        )
    if request.version != HANDLES_VERSION:
        return payload, frozenset({"INVALID_ARGUMENT"}), attach_fds
    return payload, frozenset({"granted", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}), attach_fds


# -- the bystander and the rig -----------------------------------------------------------------
class Bystander:
    """A real session holding known bytes through every fault, checked after each batch."""

    def __init__(self, socket_dir: Path) -> None:
        self.session = tidalpool.attach(
            socket_dir, device_limit="4MiB", host_limit="2MiB", job_name="bystander"
        )
        self.array = self.session.array(4096, "uint8")
        self.array[:] = np.arange(4096) % 251

    def check(self, context: str) -> None:
        s = self.session
        assert not s.closed, f"{context}: the bystander's session ended"
        assert np.array_equal(self.array, np.arange(4096) % 251), (
            f"{context}: the bystander's bytes changed"
        )
        s.free(s.malloc(1024))  # still allocates
        assert s.stats().events_received >= 0, f"{context}: the daemon no longer answers Stats"

    def close(self) -> None:
        self.session.close()


def fuzz_seed(name: str) -> tuple[str, random.Random]:
    """The run's seed ($TIDALPOOL_FUZZ_SEED, else fresh), printed so a failure shows it, and an
    RNG for `name` drawn from it."""
    seed = os.environ.get(SEED_ENV) or str(secrets.randbits(32))
    print(f"fuzz seed {seed} (rerun with {SEED_ENV}={seed})")
    return seed, random.Random(f"{seed}/{name}")


@dataclass
class Rig:
    """A daemon, its bystander and its numbers before the fuzzing, and the checks run after
    every batch and at the end."""

    daemon: LocalDaemon
    target: Target
    bystander: Bystander
    seed: str
    rng: random.Random
    rss_before: int = 0
    fds_before: int = 0
    batches: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.daemon.process.pid

    def check(self, outcomes: list[Outcome]) -> None:
        """After a batch: every answer expected, the daemon alive and answering, the bystander
        intact."""
        self.batches += 1
        context = f"seed {self.seed}, batch {self.batches}"
        self.outcomes += outcomes
        unexpected = [o for o in outcomes if not o.expected]
        assert not unexpected, f"{context}: {len(unexpected)} unexpected answers:\n" + "\n".join(
            f"  {o.target}: {o.what}" for o in unexpected[:10]
        )
        self.alive(context)
        assert self.target.serving(), f"{context}: the daemon is not SERVING"
        self.target.pool_status()
        self.target.sessions()
        self.bystander.check(context)

    def alive(self, context: str) -> None:
        code = self.daemon.process.poll()
        assert code is None, (
            f"{context}: the daemon exited with {code}:\n{self.daemon.log_path.read_text()[-3000:]}"
        )

    def finish(self) -> None:
        """Every session ends; then exact accounting, and RSS and fds back within bounds."""
        context = f"seed {self.seed}, at the end"
        self.bystander.close()
        self.target.evict_pending()
        try:
            wait_for(lambda: not self.target.sessions(), "every session to end", 60)
        except AssertionError as e:
            left = [(s.session_id, s.job_name, s.state) for s in self.target.session_infos()]
            raise AssertionError(f"{context}: {e}; still there: {left}") from None
        status = self.target.pool_status()
        for name, usage in (("device", status.device), ("host", status.host)):
            assert (usage.leased_bytes, usage.free_bytes, usage.used_bytes) == (
                0,
                usage.total_bytes,
                0,
            ), f"{context}: {name} pool {usage}"
        assert status.device.total_bytes == status.host.total_bytes == 256 * MiB
        assert status.sessions == 0
        self.alive(context)
        check_bounds(self.pid, self.rss_before, self.fds_before, context)


def check_bounds(pid: int, rss_before: int, fds_before: int, context: str) -> None:
    """The daemon's open fds come back within FD_SLACK of `fds_before` (closing is
    asynchronous: polled) and its RSS within RSS_SLACK of `rss_before`."""
    with suppress(AssertionError):
        wait_for(lambda: daemon_open_fds(pid) <= fds_before + FD_SLACK, "fds to close", 10)
    fds = daemon_open_fds(pid)
    assert fds <= fds_before + FD_SLACK, (
        f"{context}: the daemon holds {fds} fds, {fds_before} before (+{FD_SLACK} allowed)"
    )
    rss = daemon_rss_bytes(pid)
    assert rss <= rss_before + RSS_SLACK, (
        f"{context}: daemon RSS {rss / MiB:.1f} MiB, {rss_before / MiB:.1f} MiB before"
        f" (+{RSS_SLACK // MiB} MiB allowed)"
    )


FUZZ_DAEMON_ARGS = ("--attach-timeout-s", "15")
"""Sessions the fuzz opens stay pending or stream-less for a whole batch (a second or two) on a
busy machine without being reaped; each is detached by the fuzz itself, but one granted to a
peer that hung up before reading its reply is reclaimed only after this."""


def ready(d: LocalDaemon) -> LocalDaemon:
    """`d` once its handles socket is there too: gRPC's health service answers SERVING for ""
    as soon as the gRPC server starts, which `LocalDaemon.start` waits for, and the handles
    socket is bound after it."""
    wait_for(lambda: (d.socket_dir / HANDLES_SOCKET).exists(), "handles.sock", 30)
    return d


def start_rig(start_daemon: StartDaemon, name: str, *extra: str) -> Rig:
    d = ready(start_daemon(*FUZZ_DAEMON_ARGS, *extra))
    if not os.access(f"/proc/{d.process.pid}/fd", os.R_OK):
        pytest.skip("the daemon's /proc/PID/fd is not readable here (it is non-dumpable)")
    target = Target(d.socket_dir)
    seed, rng = fuzz_seed(name)
    rig = Rig(d, target, Bystander(d.socket_dir), seed, rng)
    rig.rss_before = steady_rss(rig.pid)
    rig.fds_before = daemon_open_fds(rig.pid)
    return rig


def steady_rss(pid: int, timeout: float = 20.0) -> int:
    """The process's RSS once it holds still (the planner's modules load on a thread of the
    daemon after it starts serving): two readings half a second apart within 1 MiB."""
    readings = [daemon_rss_bytes(pid)]

    def still() -> bool:
        time.sleep(0.5)  # the interval between two readings, not a wait for a state
        readings.append(daemon_rss_bytes(pid))
        return abs(readings[-1] - readings[-2]) < MiB

    with suppress(AssertionError):
        wait_for(still, "the daemon's RSS to hold still", timeout)
    return readings[-1]


@pytest.fixture
def rig(start_daemon: StartDaemon, request: pytest.FixtureRequest) -> Iterator[Rig]:
    r = start_rig(start_daemon, request.node.name)
    yield r
    r.target.close()
    with suppress(Exception):
        r.bystander.close()


# -- the tests ---------------------------------------------------------------------------------
UNARY_BATCHES, UNARY_PER_BATCH = 5, 60  # 300 requests per RPC
STREAM_BATCHES, STREAM_PER_BATCH = 5, 100  # 500 stream messages, five sessions
HANDLES_BATCHES, HANDLES_PER_BATCH = 5, 60  # 300 handles exchanges


@pytest.mark.parametrize("method", sorted(UNARY))
def test_every_unary_rpc_answers_mutated_requests_with_its_codes(rig: Rig, method: str) -> None:
    for _ in range(UNARY_BATCHES):
        rig.check(rig.target.fuzz_unary(UNARY[method], rig.rng, UNARY_PER_BATCH))
    rig.finish()
    assert len(rig.outcomes) >= UNARY_BATCHES * UNARY_PER_BATCH * 0.9


def test_session_streams_refuse_mutated_messages_and_go_on(rig: Rig) -> None:
    for _ in range(STREAM_BATCHES):
        rig.check(rig.target.fuzz_stream(rig.rng, STREAM_PER_BATCH))
    rig.finish()


def test_the_handles_socket_answers_mutated_frames_and_stray_fds(rig: Rig) -> None:
    for _ in range(HANDLES_BATCHES):
        rig.check(rig.target.fuzz_handles(rig.rng, HANDLES_PER_BATCH))
    rig.finish()
    assert {o.code for o in rig.outcomes} >= {"granted", "closed", "INVALID_ARGUMENT"}


def test_silent_and_dripping_handles_peers_do_not_delay_an_attach(rig: Rig) -> None:
    """Sixteen peers that connect and stay silent or send a byte now and then: an attach
    beside them still takes well under a second (one exchange normally takes milliseconds)."""
    path = rig.target.socket_dir / HANDLES_SOCKET
    hostile: list[socket.socket] = []
    stop = threading.Event()

    def drip() -> None:
        payload = struct.pack("<I", 60000) + b"x" * 60000
        sent = 0
        while not stop.wait(0.2):
            for sock in hostile[1::2]:
                with suppress(OSError):
                    sock.send(payload[sent : sent + 1])
            sent += 1

    dripper = threading.Thread(target=drip, name="drip", daemon=True)
    try:
        for _ in range(16):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(path))
            hostile.append(sock)
        dripper.start()
        request = frame(
            handles_pb2.HandlesRequest(
                version=HANDLES_VERSION, device_bytes=2 * MiB, host_bytes=2 * MiB, job_name="late"
            ).SerializeToString()
        )
        for i in range(5):
            started = time.monotonic()
            reply = handles_exchange(path, request, timeout=3.0)
            took = time.monotonic() - started
            assert reply.outcome == "granted", (
                f"attach {i} beside 16 silent or dripping peers: {reply.outcome} after {took:.2f} s"
            )
            assert took < 1.0, f"attach {i} beside 16 silent or dripping peers took {took:.2f} s"
            assert reply.response is not None
            session = RawSession(reply.response.session_id, reply.response.token)
            assert detach_raw(rig.target.pool, session) == Code.OK
    finally:
        stop.set()
        for sock in hostile:
            sock.close()
        if dripper.is_alive():
            dripper.join()
    rig.check([])
    rig.finish()


def test_heartbeats_at_their_extremes_leave_pool_status_answering(rig: Rig) -> None:
    """Two sessions report 2**64 - 1 of everything: PoolStatus and ListSessions still answer,
    and no pool reports more bytes used than it has leased."""
    sessions = [rig.target.raw_session(attach=True) for _ in range(2)]
    streams = [RawStream(rig.target.pool, token_metadata(s.token)) for s in sessions]
    try:
        for stream in streams:
            assert stream.opened()
            stream.send(pool_pb2.ClientMessage(heartbeat=_EXTREME_BEAT).SerializeToString())
            stream.send(STREAM_SENTINEL)
            stream.wait_for_error(str(U64_MAX))
        status = rig.target.pool_status()
        for usage in (status.device, status.host):
            assert usage.used_bytes <= usage.leased_bytes, f"{usage}"
        assert set(rig.target.sessions()) >= {s.id for s in sessions}
        rig.check([])
    finally:
        for stream in streams:
            stream.close()
        rig.target.end(sessions)
    rig.finish()


def test_op_names_past_their_bound_are_refused_and_the_session_goes_on(rig: Rig) -> None:
    """Chunks of 1,024 new op names of 512 bytes each, one after the other: those within
    max_trace_name_bytes are kept; the first that would pass it is refused whole (its event
    too) with RESOURCE_EXHAUSTED or INVALID_ARGUMENT, and the session goes on."""
    from tidalpoold.settings import Settings

    bound = Settings().max_trace_name_bytes
    names, name_bytes = 1024, 512
    session = rig.target.raw_session(attach=True)
    stream = RawStream(rig.target.pool, token_metadata(session.token))

    def op_chunk(first: int, new_names: dict[int, str]) -> bytes:
        return pool_pb2.ClientMessage(
            trace=pool_pb2.TraceChunk(
                first_event=first,
                kinds=[pool_pb2.EVENT_KIND_OP],
                block_ids=[0],
                sizes=[0],
                durations_ns=[100],
                name_ids=[min(new_names, default=0)],
                new_names=new_names,
            )
        ).SerializeToString()

    def events() -> int:
        code, reply = call_raw(
            rig.target.pool, f"/{POOL_SERVICE}/Stats", b"", token_metadata(session.token)
        )
        assert code == Code.OK and isinstance(reply, bytes), f"Stats: {code.name} {reply!r}"
        return int(pool_pb2.StatsResponse.FromString(reply).session.events_received)

    def decided(errors: int, chunks: int) -> bool:
        """A chunk was refused (a new error) or kept (the daemon holds more events)."""
        return len(stream.errors()) > errors or events() > chunks

    try:
        assert stream.opened()
        kept, refused = 0, None
        for k in range(2 * bound // (names * name_bytes) + 1):  # up to twice the bound
            errors = len(stream.errors())
            first_id = k * names + 1
            chunk = {first_id + i: f"{k:04d}.{i:05d}.".ljust(name_bytes, "n") for i in range(names)}
            stream.send(op_chunk(k, chunk))
            wait_for(partial(decided, errors, k), f"chunk {k}'s fate")
            if len(stream.errors()) > errors:
                refused = stream.errors()[-1]
                break
            kept += names * name_bytes
        assert refused is not None, f"{kept} bytes of op names kept ({bound} allowed), none refused"
        assert refused.code in ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"), refused
        assert bound // 2 <= kept <= bound, f"{kept} bytes of names kept, the bound is {bound}"
        chunks_kept = kept // (names * name_bytes)
        assert events() == chunks_kept, "the refused chunk's event was kept"
        stream.send(op_chunk(chunks_kept, {}))  # the session goes on
        wait_for(lambda: events() == chunks_kept + 1, "the next chunk to be kept")
        rig.check([])
    finally:
        stream.close()
        rig.target.end([session])
    rig.finish()


def test_a_flood_of_bad_stream_messages_costs_few_log_lines(rig: Rig) -> None:
    """2,000 malformed messages on one stream: each is refused on the stream, and the daemon's
    log says so in at most 50 lines (a log is read by people; a peer must not fill the disk)."""
    session = rig.target.raw_session(attach=True)
    stream = RawStream(rig.target.pool, token_metadata(session.token))
    try:
        assert stream.opened()
        beat = pool_pb2.ClientMessage(heartbeat=pool_pb2.Heartbeat()).SerializeToString()
        for k in range(2000):
            stream.send(b"\xff\xff")
            if k % 100 == 99:  # alive however long a busy machine takes over the flood
                stream.send(beat)
        stream.send(STREAM_SENTINEL)
        # The daemon drops refusals past 256 queued for a client that reads them slower than it
        # floods (a loaded machine): the sentinel's may be one. Sent again each second, with a
        # heartbeat, until its refusal arrives; the test is about what the daemon logs.
        stream.wait_for_error(str(U64_MAX), nudge=(STREAM_SENTINEL, beat))
        rig.check([])
    finally:
        stream.close()
        rig.target.end([session])
    lines = [ln for ln in rig.daemon.log_path.read_text().splitlines() if session.id in ln]
    assert len(lines) <= 50, f"{len(lines)} log lines for one flooding session:\n" + "\n".join(
        lines[:5]
    )
    rig.finish()


def test_evicting_a_huge_id_is_refused_in_a_few_words(rig: Rig) -> None:
    """An id of 64 KiB is no session's: NOT_FOUND or INVALID_ARGUMENT, and the message does not
    echo it whole (gRPC's limit on status details is 16 KiB: an echo would turn the answer into
    a transport error)."""
    request = admin_pb2.EvictSessionRequest(session_id="s-" + "9" * (64 * KiB), reason="r" * KiB)
    code, details = call_raw(
        rig.target.admin, f"/{ADMIN_SERVICE}/EvictSession", request.SerializeToString()
    )
    assert code in (Code.NOT_FOUND, Code.INVALID_ARGUMENT), f"{code.name}: {str(details)[:300]}"
    assert len(details) <= KiB, f"{len(details)} characters of details"
    rig.check([])
    rig.finish()
