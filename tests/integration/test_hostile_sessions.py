"""A hostile local client against a real daemon, over its real sockets with raw messages: what
it reports is checked, what it can make the daemon hold is bounded, what it sends back is cut
short, and the pool's accounting stays exact when scrubbing fails (the daemon out of open
files while a client that held chunks is killed)."""

from __future__ import annotations

import json
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tidalclient.errors import AttachError
from tidalclient.handles import request_lease
from tidalclient.local import LocalDaemon
from tidalcore import wire
from tidalcore.v1 import admin_pb2, admin_pb2_grpc, common_pb2, pool_pb2, pool_pb2_grpc

from tools.prometheus import metrics_address

from ..conftest import StartDaemon

MiB = 1 << 20
U64_MAX = 2**64 - 1
WORKER = Path(__file__).with_name("worker.py")
DEADLINE_S = 30.0  # generous: the machine may be busy

NO_BODY = "client message has no body (heartbeat, trace, step or lease_return)"


def admin_channel(d: LocalDaemon) -> grpc.Channel:
    """A channel to the daemon's Admin service: its own socket where the daemon serves one,
    else the gRPC socket (the one place that knows where Admin is)."""
    name = getattr(wire, "ADMIN_SOCKET", None)
    path = d.socket_dir / name if name else d.socket_dir / wire.GRPC_SOCKET
    if not path.exists():
        path = d.socket_dir / wire.GRPC_SOCKET
    return grpc.insecure_channel(f"unix:{path}")


def pool_status(channel: grpc.Channel) -> admin_pb2.PoolStatusResponse:
    reply: admin_pb2.PoolStatusResponse = admin_pb2_grpc.AdminStub(channel).PoolStatus(
        admin_pb2.PoolStatusRequest(), timeout=10
    )
    return reply


def wait_for(what: str, done: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.02)


class RawSession:
    """A session opened by hand: a lease from the handles socket (its fds closed unmapped), an
    Attach with its token, and its stream fed raw bytes; what the daemon sends is kept."""

    def __init__(self, d: LocalDaemon, device_bytes: int = 2 * MiB, host_bytes: int = 2 * MiB):
        grant = request_lease(d.socket_dir / wire.HANDLES_SOCKET, device_bytes, host_bytes, "evil")
        grant.close()
        self.id = grant.response.session_id
        self.metadata = ((wire.TOKEN_KEY, grant.response.token),)
        self.channel = grpc.insecure_channel(f"unix:{d.socket_dir / wire.GRPC_SOCKET}")
        self.stub = pool_pb2_grpc.PoolStub(self.channel)
        self.stub.Attach(pool_pb2.AttachRequest(), metadata=self.metadata, timeout=10)
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        stream = self.channel.stream_stream(
            "/tidalpool.v1.Pool/Session",
            request_serializer=None,
            response_deserializer=pool_pb2.ServerMessage.FromString,
        )
        self._responses = stream(iter(self._outbox.get, None), metadata=self.metadata)
        assert (wire.STREAM_OPEN_KEY, "1") in (self._responses.initial_metadata() or ())
        self.replies: list[pool_pb2.ServerMessage] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for msg in self._responses:
                self.replies.append(msg)
        except grpc.RpcError:
            pass

    def send(self, message: pool_pb2.ClientMessage | bytes) -> None:
        raw = message if isinstance(message, bytes) else message.SerializeToString()
        self._outbox.put(raw)

    @property
    def errors(self) -> list[pool_pb2.SessionError]:
        return [m.error for m in list(self.replies) if m.WhichOneof("body") == "error"]

    def wait_errors(self, n: int, timeout: float = DEADLINE_S) -> list[tuple[str, str]]:
        wait_for(f"{n} session errors", lambda: len(self.errors) >= n, timeout)
        return [(e.code, e.message) for e in self.errors]

    def stats(self) -> common_pb2.SessionInfo:
        reply: pool_pb2.StatsResponse = self.stub.Stats(
            pool_pb2.StatsRequest(), metadata=self.metadata, timeout=10
        )
        return reply.session

    def close(self) -> None:
        self._outbox.put(None)
        self.channel.close()


@pytest.fixture
def raw_sessions() -> Iterator[list[RawSession]]:
    """Sessions a test opens; every one is closed at its end."""
    opened: list[RawSession] = []
    yield opened
    for s in opened:
        s.close()


def beat(**fields: int) -> pool_pb2.ClientMessage:
    return pool_pb2.ClientMessage(heartbeat=pool_pb2.Heartbeat(**fields))


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "gpu"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def log_events(d: LocalDaemon, event: str) -> list[dict[str, object]]:
    """The daemon's JSON log lines of `event`."""
    records = (json.loads(line) for line in d.log_path.read_text().splitlines() if line[:1] == "{")
    return [r for r in records if r.get("event") == event]


# -- heartbeats ----------------------------------------------------------------------------------


def test_overflowing_heartbeats_are_refused_and_status_and_metrics_keep_answering(
    start_daemon: StartDaemon, raw_sessions: list[RawSession]
) -> None:
    d = start_daemon("--metrics-address", "127.0.0.1:0", "--log-format", "json")
    address = metrics_address(d.log_path)
    raw_sessions += [RawSession(d), RawSession(d)]
    for s in raw_sessions:
        s.send(beat(device_used_bytes=1000, device_peak_bytes=1500, swapped_out_bytes=10))
        s.send(beat(device_used_bytes=U64_MAX, device_peak_bytes=U64_MAX))
    for s in raw_sessions:
        assert s.wait_errors(1) == [
            (
                "INVALID_ARGUMENT",
                f"heartbeat device_used_bytes {U64_MAX} exceeds the session's device lease of"
                f" {2 * MiB} bytes",
            )
        ]
    with admin_channel(d) as ch:
        status = pool_status(ch)
        listed = admin_pb2_grpc.AdminStub(ch).ListSessions(
            admin_pb2.ListSessionsRequest(), timeout=10
        )
    assert (status.device.leased_bytes, status.device.used_bytes) == (4 * MiB, 2000)
    assert sorted(
        (i.device_used_bytes, i.device_peak_bytes, i.swapped_out_bytes) for i in listed.sessions
    ) == [(1000, 1500, 10), (1000, 1500, 10)]
    metrics = scrape(address)
    assert metrics["tidalpool_pool_bytes", (("pool", "device"), ("state", "used"))] == 2000
    assert metrics["tidalpool_swapped_bytes_total", (("direction", "out"),)] == 20

    # A count going down, or past int64, is refused too; the next good heartbeat is taken.
    first, second = raw_sessions
    first.send(beat(device_used_bytes=1000, swapped_out_bytes=9))
    second.send(beat(swap_stall_ns=2**63, swapped_out_bytes=10))
    assert first.wait_errors(2)[1] == (
        "INVALID_ARGUMENT",
        "heartbeat swapped_out_bytes 9 is below the 10 reported before: a count since attach"
        " never decreases",
    )
    assert second.wait_errors(2)[1] == (
        "INVALID_ARGUMENT",
        f"heartbeat swap_stall_ns {2**63} exceeds the bound of a count ({2**63 - 1})",
    )
    first.send(beat(device_used_bytes=2 * MiB, swapped_out_bytes=11))
    wait_for("the good heartbeat taken", lambda: first.stats().device_used_bytes == 2 * MiB)
    assert first.stats().swapped_out_bytes == 11
    with admin_channel(d) as ch:
        assert pool_status(ch).device.used_bytes == 2 * MiB + 1000
    assert scrape(address)["tidalpool_swapped_bytes_total", (("direction", "out"),)] == 21


def test_detach_with_a_bad_last_heartbeat_is_refused_and_the_session_stays(
    daemon: LocalDaemon, raw_sessions: list[RawSession]
) -> None:
    s = RawSession(daemon)
    raw_sessions.append(s)
    with pytest.raises(grpc.RpcError) as e:
        s.stub.Detach(
            pool_pb2.DetachRequest(last=pool_pb2.Heartbeat(host_used_bytes=U64_MAX)),
            metadata=s.metadata,
            timeout=10,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        f"heartbeat host_used_bytes {U64_MAX} exceeds the session's host lease of {2 * MiB} bytes"
    )
    assert s.stats().session_id == s.id  # still there
    ended = s.stub.Detach(
        pool_pb2.DetachRequest(last=pool_pb2.Heartbeat(host_used_bytes=MiB)),
        metadata=s.metadata,
        timeout=10,
    )
    assert ended.session.host_used_bytes == MiB
    with admin_channel(daemon) as ch:
        status = pool_status(ch)
    assert (status.device.leased_bytes, status.host.leased_bytes) == (0, 0)


# -- op names ------------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_op_names_cannot_grow_the_daemon(
    daemon: LocalDaemon, raw_sessions: list[RawSession]
) -> None:
    """Chunks of 3500 new names of 1 KiB each (3.6 MB on the wire), 40 of them, from a 2 MiB
    lease: the first fits the 4 MiB of names a session may define, the rest are refused, and
    the daemon's memory does not follow."""
    s = RawSession(daemon)
    raw_sessions.append(s)
    before = rss_bytes(daemon.process.pid)
    per_chunk = 3500
    for k in range(40):
        names = {k * per_chunk + i + 1: "n" * 1024 for i in range(per_chunk)}
        s.send(pool_pb2.ClientMessage(trace=pool_pb2.TraceChunk(first_event=0, new_names=names)))
    refusal = (
        "INVALID_ARGUMENT",
        "trace chunk's op names would bring the session's to 8064000 bytes, more than"
        " max_trace_name_bytes (4194304; each name counts its UTF-8 bytes + 128)",
    )
    assert s.wait_errors(39) == [refusal] * 39
    grown = rss_bytes(daemon.process.pid) - before
    assert grown < 64 * MiB, f"the daemon grew by {grown} bytes"

    # One name longer than 1 KiB is refused whole, with the events beside it.
    s.send(
        pool_pb2.ClientMessage(
            trace=pool_pb2.TraceChunk(
                first_event=0,
                kinds=[pool_pb2.EVENT_KIND_OP],
                block_ids=[1],
                sizes=[0],
                durations_ns=[5],
                name_ids=[1],
                new_names={10**6: "x" * 1025},
            )
        )
    )
    assert s.wait_errors(40)[39] == (
        "INVALID_ARGUMENT",
        "trace chunk defines op name 1000000 of 1025 bytes, longer than 1024",
    )
    assert s.stats().events_received == 0


# -- leases, ids, logs ---------------------------------------------------------------------------


def test_leases_never_attached_are_bounded_per_uid(start_daemon: StartDaemon) -> None:
    d = start_daemon("--max-pending-per-uid", "2", "--attach-timeout-s", "60")
    handles = d.socket_dir / wire.HANDLES_SOCKET
    for _ in range(2):
        request_lease(handles, 2 * MiB, 2 * MiB, "hoarder").close()
    with pytest.raises(AttachError) as e:
        request_lease(handles, 2 * MiB, 2 * MiB, "hoarder")
    assert str(e.value) == (
        f"tidalpoold refused the session (RESOURCE_EXHAUSTED): uid {os.getuid()} already holds 2"
        " leases not attached, the most one uid may (max_pending_per_uid 2): attach them, or"
        " wait 60 s (attach_timeout_s) for them to be reclaimed"
    )
    with admin_channel(d) as ch:
        assert pool_status(ch).device.leased_bytes == 4 * MiB


def test_evict_never_echoes_a_long_id_or_reason(
    daemon: LocalDaemon, raw_sessions: list[RawSession]
) -> None:
    s = RawSession(daemon)
    raw_sessions.append(s)
    admin_stub = admin_pb2_grpc.AdminStub
    with admin_channel(daemon) as ch:
        with pytest.raises(grpc.RpcError) as e:
            admin_stub(ch).EvictSession(
                admin_pb2.EvictSessionRequest(session_id="s" * 100_000), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == (
            f"session_id '{'s' * 64}'… (100000 bytes) is longer than a session id (14 characters)"
        )
        with pytest.raises(grpc.RpcError) as e:
            admin_stub(ch).EvictSession(
                admin_pb2.EvictSessionRequest(session_id="s-000000000000"), timeout=10
            )
        assert (e.value.code(), e.value.details()) == (
            grpc.StatusCode.NOT_FOUND,
            "no session 's-000000000000'",
        )
        admin_stub(ch).EvictSession(
            admin_pb2.EvictSessionRequest(session_id=s.id, reason="r" * 100_000), timeout=10
        )
    wait_for("the goodbye", lambda: any(m.WhichOneof("body") == "goodbye" for m in s.replies))
    (goodbye,) = [m.goodbye for m in s.replies if m.WhichOneof("body") == "goodbye"]
    assert goodbye.message == "r" * 256 + "… (100000 bytes)"
    assert max(len(line) for line in daemon.log_path.read_text().splitlines()) < 2000


def test_bad_messages_are_each_answered_but_logged_sparingly(
    start_daemon: StartDaemon, raw_sessions: list[RawSession]
) -> None:
    d = start_daemon("--log-format", "json")
    s = RawSession(d)
    raw_sessions.append(s)
    for sent in range(100, 2001, 100):  # in batches: the client reads as it goes
        for _ in range(100):
            s.send(b"")  # a ClientMessage with no body
        s.wait_errors(sent)
    errors = s.wait_errors(2000)
    assert errors == [("INVALID_ARGUMENT", NO_BODY)] * 2000
    s.send(beat(device_used_bytes=1))  # the stream is still served after them
    wait_for("the heartbeat taken", lambda: s.stats().device_used_bytes == 1)
    logged = log_events(d, "session.bad_message")
    assert [r["count"] for r in logged] == [1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert {r["session"] for r in logged} == {s.id}
    assert logged[-1]["note"] == (
        "1024 messages of this session refused so far: the first 5 are logged, then one line at"
        " each power of two"
    )


# -- scrubbing at the open-files limit -----------------------------------------------------------


def test_chunks_of_a_killed_client_are_quarantined_at_the_fd_limit_and_freed_after(
    daemon: LocalDaemon,
) -> None:
    """The daemon at its open-files limit cannot renew a chunk's memfd as it scrubs it: the
    chunks of a client killed then are counted as quarantined, never lost nor leased, and
    return to the pool once the daemon has open files again."""
    with subprocess.Popen(
        [sys.executable, str(WORKER), str(daemon.socket_dir), "7"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as worker:
        try:
            held_by_a_killed_client(daemon, worker)
        finally:
            if worker.poll() is None:
                worker.kill()


def held_by_a_killed_client(daemon: LocalDaemon, worker: subprocess.Popen[str]) -> None:
    """Kill `worker` while the daemon has no open file to spare; check the pools after, and
    once the limit is back."""
    assert worker.stdout is not None
    assert worker.stdout.readline().split()[0] == "ready"
    pid = daemon.process.pid
    with admin_channel(daemon) as ch:  # connected before the limit: no new fd needed
        status = pool_status(ch)
        total_device, total_host = status.device.total_bytes, status.host.total_bytes
        assert (status.device.leased_bytes, status.host.leased_bytes) == (16 * MiB, 64 * MiB)
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (16, hard))  # far below its fds
        try:
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=DEADLINE_S)

            def reclaimed() -> bool:
                now = pool_status(ch)
                return now.device.leased_bytes == now.host.leased_bytes == 0

            wait_for("the killed client's leases ended", reclaimed)
            status = pool_status(ch)
            for usage, total, lease in (
                (status.device, total_device, 16 * MiB),
                (status.host, total_host, 64 * MiB),
            ):
                assert (usage.quarantined_bytes, usage.free_bytes) == (lease, total - lease)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))

        def restored() -> bool:
            now = pool_status(ch)
            return now.device.quarantined_bytes == now.host.quarantined_bytes == 0

        wait_for("the quarantined chunks freed", restored)
        status = pool_status(ch)
    for usage, total in ((status.device, total_device), (status.host, total_host)):
        assert (usage.leased_bytes, usage.free_bytes, usage.quarantined_bytes) == (0, total, 0)
