"""The end of a session against a real daemon: once the daemon has ended it (an operator's
eviction, a heartbeat timeout, a shutdown) nothing of it computes on the scrubbed lease, and a
client's own close delivers its whole trace before it detaches."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import pytest
import tidalpool
from tidalclient.local import LocalDaemon
from tidalcore import wire
from tidalcore.chunks import ChunkMapping
from tidalcore.v1 import admin_pb2, admin_pb2_grpc

from ..conftest import StartDaemon

MiB = 1 << 20


def admin_channel(d: LocalDaemon) -> grpc.Channel:
    """A channel to the Admin service: its own socket where the daemon serves one, else the
    gRPC socket it shares with the Pool service."""
    name: str | None = getattr(wire, "ADMIN_SOCKET", None)
    path = d.socket_dir / name if name is not None else None
    if path is None or not path.exists():
        path = d.socket_dir / wire.GRPC_SOCKET
    return grpc.insecure_channel(f"unix:{path}")


def evict(d: LocalDaemon, session_id: str, reason: str) -> None:
    with admin_channel(d) as ch:
        admin_pb2_grpc.AdminStub(ch).EvictSession(
            admin_pb2.EvictSessionRequest(session_id=session_id, reason=reason), timeout=10
        )


def session_ids(d: LocalDaemon) -> list[str]:
    with admin_channel(d) as ch:
        reply = admin_pb2_grpc.AdminStub(ch).ListSessions(
            admin_pb2.ListSessionsRequest(), timeout=10
        )
    return [s.session_id for s in reply.sessions]


def wait_closed(s: tidalpool.Session) -> None:
    """Until the session's listener has read the daemon's goodbye."""
    deadline = time.monotonic() + 30
    while not s.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.closed, "the daemon's goodbye never reached the session"


def over(s: tidalpool.Session, how: str) -> str:
    """The SessionClosed message of a session the daemon ended, as a pattern."""
    return re.escape(f"session {s.id} is over ({how})")


def test_an_evicted_session_refuses_every_use_of_its_lease(daemon: LocalDaemon) -> None:
    s = tidalpool.attach(daemon.socket_dir, device_limit="4MiB", job_name="evicted")
    pinned = s.array(256, "uint8")
    tensor = s.tensor((64,), "float32")
    block = s.malloc(1000)
    with s.op(reads=[pinned], writes=[tensor, block]) as (_, t, b):
        t[:], b[:] = 1.0, 7  # the session works before the eviction
    evict(daemon, s.id, "drained for maintenance")
    wait_closed(s)
    why = over(s, "evicted: drained for maintenance")
    refused: dict[str, Callable[[], object]] = {
        "op": lambda: s.op().__enter__(),
        "op on a tensor": lambda: s.op(reads=[tensor]).__enter__(),
        "record_op": lambda: s.record_op("forward", 1000),
        "step": s.step,
        "malloc": lambda: s.malloc(16),
        "array": lambda: s.array(16, "uint8"),
        "tensor": lambda: s.tensor((4,), "float32"),
        "buffer": lambda: s.buffer(block),
        "address": lambda: s.address(block),
    }
    for what, call in refused.items():
        with pytest.raises(tidalpool.SessionClosed, match=why):
            call()
            pytest.fail(f"{what} did not refuse")
    # Freeing returns what the daemon already took back: nothing to do, and no second error in
    # the cleanup code that runs after the first.
    s.free(block)
    s.release(tensor)
    s.release(pinned)
    stats = s.stats()  # the counts stay readable
    assert (stats.live_blocks, stats.mallocs, stats.events_received) == (3, 3, -1)
    assert isinstance(s.device, ChunkMapping) and isinstance(s.host, ChunkMapping)
    assert not s.device.retired
    s.close()  # still releases what the process holds
    assert s.device.retired and s.host.retired
    s.free(block)  # and after close too


def test_a_goodbye_during_an_op_raises_when_the_op_ends(daemon: LocalDaemon) -> None:
    s = tidalpool.attach(daemon.socket_dir, device_limit="4MiB", job_name="mid-op")
    a = s.array(1024, "uint8")
    why = over(s, "evicted: in the middle")
    with pytest.raises(tidalpool.SessionClosed, match=why), s.op(writes=[a]) as (v,):
        evict(daemon, s.id, "in the middle")
        wait_closed(s)
        v[:] = 3  # the body finishes; what it computed is not to be trusted
    s.close()


def test_an_error_in_the_op_body_is_not_hidden_by_the_goodbye(daemon: LocalDaemon) -> None:
    s = tidalpool.attach(daemon.socket_dir, device_limit="4MiB", job_name="mid-op")
    with pytest.raises(ZeroDivisionError), s.op():
        evict(daemon, s.id, "in the middle")
        wait_closed(s)
        _ = 1 / 0
    s.close()


def test_a_daemon_shutdown_ends_ops_too(daemon: LocalDaemon) -> None:
    s = tidalpool.attach(daemon.socket_dir, device_limit="4MiB", job_name="shutdown")
    a = s.array(16, "uint8")
    assert daemon.stop() == 0
    wait_closed(s)
    with pytest.raises(tidalpool.SessionClosed, match=r"is over \(shutdown: "):
        s.op(reads=[a]).__enter__()
    with pytest.raises(tidalpool.SessionClosed, match=r"is over \(shutdown: "):
        s.step()
    s.close()


CHILD = """
import sys, time
import tidalpool

s = tidalpool.attach(sys.argv[1], device_limit="4MiB", job_name="paused")
a = s.array(1024, "uint8")
print("ready", s.id, flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "wait-closed":
        deadline = time.monotonic() + 30
        while not s.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        print("closed" if s.closed else "open", flush=True)
    elif command == "op":
        try:
            with s.op(writes=[a]) as (v,):
                v[:] = 1
        except tidalpool.SessionClosed as e:
            print("refused:", e, flush=True)
        else:
            print("ok", flush=True)
    elif command == "quit":
        break
s.close()
"""


def ask(proc: subprocess.Popen[str], command: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_a_job_paused_past_the_heartbeat_timeout_refuses_ops_when_it_resumes(
    start_daemon: StartDaemon,
) -> None:
    d = start_daemon("--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "2")
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(d.socket_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            ready, session_id = proc.stdout.readline().split()
            assert ready == "ready"
            assert ask(proc, "op") == "ok"
            os.kill(proc.pid, signal.SIGSTOP)  # as a debugger or a paused container would
            deadline = time.monotonic() + 60
            while session_id in session_ids(d) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert session_id not in session_ids(d), "the daemon never evicted the silent job"
            os.kill(proc.pid, signal.SIGCONT)
            assert ask(proc, "wait-closed") == "closed"
            assert ask(proc, "op") == (
                f"refused: session {session_id} is over (evicted: no heartbeat for 2 s)"
            )
            assert ask(proc, "quit") == ""
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()


def ended_events(d: LocalDaemon, session_id: str) -> int:
    """The trace events the daemon had received when the session ended (its JSON log)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in d.log_path.read_text().splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record["event"] == "session.ended" and record["session"] == session_id:
                    assert record["reason"] == "detached"
                    return int(record["events"])
        time.sleep(0.05)
    raise AssertionError(f"no session.ended line for {session_id} in {d.log_path}")


@pytest.mark.parametrize("chunk_events", [4096, 16])
def test_close_delivers_the_whole_trace_before_it_detaches(
    start_daemon: StartDaemon, chunk_events: int
) -> None:
    """40,000 events recorded as fast as Python goes; with chunks of 16 events the daemon's
    reader is far behind when the client closes (2,500 messages)."""
    d = start_daemon("--log-format", "json", "--trace-chunk-events", str(chunk_events))
    with tidalpool.attach(d.socket_dir, device_limit="4MiB", job_name="busy") as s:
        for _ in range(10_000):  # 4 events each: alloc, read, op, free
            b = s.malloc(64)
            with s.op(reads=[b], name="touch"):
                pass
            s.free(b)
    assert s.recorder.events_sent == 40_000
    assert ended_events(d, s.id) == 40_000


def test_close_delivers_the_trace_of_a_swapping_session(start_daemon: StartDaemon) -> None:
    d = start_daemon("--log-format", "json", "--trace-chunk-events", "16")
    s = tidalpool.attach(d.socket_dir, device_limit="4MiB", swap_limit="64KiB")
    tensors = [s.tensor((4096,), "uint8") for _ in range(32)]  # 128 KiB: they swap
    for _ in range(200):
        for t in tensors:
            with s.op(writes=[t]) as (v,):
                v[:] = 1
        s.step()
    s.close()
    # 32 allocs, then per round: a write and an op per tensor, and an iteration mark
    assert s.recorder.events_sent == 32 + 200 * (32 * 2 + 1)
    assert ended_events(d, s.id) == 32 + 200 * (32 * 2 + 1)


def test_attach_checks_the_daemons_user_against_daemon_users(daemon: LocalDaemon) -> None:
    """attach's `daemon_users` reaches the handles exchange: a daemon running as a user not
    listed is refused before it is asked for anything."""
    with pytest.raises(
        tidalpool.AttachError,
        match=re.escape("a user this client does not accept (accepted: uid 4242424)"),
    ):
        tidalpool.attach(daemon.socket_dir, daemon_users="4242424")
    assert session_ids(daemon) == []
    with tidalpool.attach(daemon.socket_dir, daemon_users=str(os.getuid())) as s:
        assert session_ids(daemon) == [s.id]
