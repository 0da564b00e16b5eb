"""Bad input and faults: each is refused precisely and no other session notices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tidalpool
from tidalclient import status
from tidalclient.local import LocalDaemon
from tidalcore import framing
from tidalcore.v1 import admin_pb2, admin_pb2_grpc, common_pb2, handles_pb2, pool_pb2, pool_pb2_grpc

from ..conftest import StartDaemon

MiB = 1 << 20
WORKER = Path(__file__).with_name("worker.py")


def channel(d: LocalDaemon) -> grpc.Channel:
    return grpc.insecure_channel(f"unix:{d.socket_dir / 'tidalpool.sock'}")


def admin_channel(d: LocalDaemon) -> grpc.Channel:
    return grpc.insecure_channel(f"unix:{d.socket_dir / 'admin.sock'}")


@pytest.fixture
def bystander(daemon: LocalDaemon):  # type: ignore[no-untyped-def]
    """Another session with known bytes, checked untouched after each fault."""
    s = tidalpool.attach(daemon.socket_dir, device_limit="4MiB", job_name="bystander")
    a = s.array(4096, "uint8")
    a[:] = np.arange(4096) % 251
    yield s
    assert np.array_equal(a, np.arange(4096) % 251)
    assert s.malloc(1024).size == 1024  # still serving
    assert not s.closed
    s.close()


@pytest.mark.parametrize("method", ["Attach", "Stats", "Detach"])
def test_forged_token_is_unauthenticated(
    daemon: LocalDaemon, bystander: tidalpool.Session, method: str
) -> None:
    requests = {
        "Attach": pool_pb2.AttachRequest(),
        "Stats": pool_pb2.StatsRequest(),
        "Detach": pool_pb2.DetachRequest(),
    }
    with channel(daemon) as ch:
        stub = pool_pb2_grpc.PoolStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            getattr(stub, method)(
                requests[method], metadata=(("tidalpool-token", "forged"),), timeout=5
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "unknown session token" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            getattr(stub, method)(requests[method], timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_forged_token_cannot_open_a_stream(
    daemon: LocalDaemon, bystander: tidalpool.Session
) -> None:
    with channel(daemon) as ch:
        replies = pool_pb2_grpc.PoolStub(ch).Session(
            iter([]), metadata=(("tidalpool-token", "x"),), timeout=5
        )
        with pytest.raises(grpc.RpcError) as e:
            list(replies)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "method",
    [
        "/tidalpool.v1.Pool/Attach",
        "/tidalpool.v1.Admin/EvictSession",
        "/grpc.health.v1.Health/Check",
    ],
)
def test_malformed_message_is_invalid_argument(
    daemon: LocalDaemon, bystander: tidalpool.Session, method: str
) -> None:
    with admin_channel(daemon) if "Admin" in method else channel(daemon) as ch:
        call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff\xff", timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in e.value.details()


def test_malformed_trace_chunk_is_refused_and_the_session_goes_on(
    daemon: LocalDaemon, bystander: tidalpool.Session
) -> None:
    with tidalpool.attach(daemon.socket_dir) as s:
        s.recorder.flush()
        bad = pool_pb2.TraceChunk(
            first_event=0, kinds=[pool_pb2.EVENT_KIND_ALLOC], block_ids=[1, 2]
        )
        s.connection.send(pool_pb2.ClientMessage(trace=bad))  # as a broken client would
        deadline = time.monotonic() + 3
        while not s.errors and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [(e.code, e.message) for e in s.errors] == [
            (
                "INVALID_ARGUMENT",
                "trace chunk columns differ in length: {'kinds': 1, 'block_ids': 2, 'sizes': 0, "
                "'durations_ns': 0, 'name_ids': 0}",
            )
        ]
        s.free(s.malloc(100))
        deadline = time.monotonic() + 3
        while s.stats().events_received != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.stats().events_received == 2  # the session goes on after the refusal


def test_size_errors_name_the_sizes(daemon: LocalDaemon, bystander: tidalpool.Session) -> None:
    with tidalpool.attach(daemon.socket_dir, device_limit="2MiB") as s:
        with pytest.raises(ValueError, match="malloc of 0 bytes"):
            s.malloc(0)
        with pytest.raises(
            MemoryError, match=r"3145728 bytes\) exceeds the lease of 2 MiB \(2097152 bytes\)"
        ):
            s.malloc(3 * MiB)
        big = s.malloc(2 * MiB - 256)
        with pytest.raises(tidalpool.LeaseExceeded, match="512 bytes"):
            s.malloc(512)
        s.free(big)


def test_double_free_and_foreign_block_name_the_block(
    daemon: LocalDaemon, bystander: tidalpool.Session
) -> None:
    with tidalpool.attach(daemon.socket_dir) as s:
        block = s.malloc(1000)
        s.free(block)
        with pytest.raises(
            tidalpool.InvalidBlock, match=r"block 1 \(offset 0, 1000 bytes\) is not live"
        ):
            s.free(block)
        foreign = bystander.malloc(64)
        with pytest.raises(tidalpool.InvalidBlock, match="belongs to another session"):
            s.free(foreign)
        with pytest.raises(tidalpool.InvalidBlock, match="belongs to another session"):
            s.release(bystander.array(8, "uint8"))
        bystander.free(foreign)


def test_pool_exhausted_is_refused_at_the_handles_socket(
    daemon: LocalDaemon, bystander: tidalpool.Session
) -> None:
    with pytest.raises(
        tidalpool.AttachError, match=r"RESOURCE_EXHAUSTED.*device pool cannot lease"
    ):
        tidalpool.attach(daemon.socket_dir, device_limit="1GiB")


def test_unknown_handles_version_is_refused(daemon: LocalDaemon) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(daemon.socket_dir / "handles.sock"))
        framing.send(sock, handles_pb2.HandlesRequest(version=9))
        reply, fds = framing.receive(sock, handles_pb2.HandlesResponse)
    assert (reply.error_code, fds) == ("INVALID_ARGUMENT", [])
    assert "version 9" in reply.error_message


def test_evict_ends_one_session_only(daemon: LocalDaemon, bystander: tidalpool.Session) -> None:
    s = tidalpool.attach(daemon.socket_dir, job_name="victim")
    with admin_channel(daemon) as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            admin.EvictSession(admin_pb2.EvictSessionRequest(session_id="s-nope"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        ended = admin.EvictSession(
            admin_pb2.EvictSessionRequest(session_id=s.id, reason="test"), timeout=5
        )
    assert ended.session.job_name == "victim"
    deadline = time.monotonic() + 3
    while not s.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(tidalpool.SessionClosed, match="evicted: test"):
        s.malloc(1)
    assert not s.device.retired
    s.close()  # still releases what the process holds
    assert s.device.retired and s.host.retired


def test_an_evicted_client_that_keeps_writing_never_reaches_the_next_holder(
    daemon: LocalDaemon,
) -> None:
    """A client ignoring its goodbye still maps its old chunks: the daemon renewed them (new
    memfds) when it scrubbed them, so the stale mapping writes into orphans only."""
    s = tidalpool.attach(daemon.socket_dir, device_limit="4MiB", job_name="evicted")
    stale = s.buffer(s.malloc(4 * MiB))  # the session refuses its lease once it is evicted
    chunks = list(status.fetch(daemon.socket_dir)[1].sessions[0].lease.device.chunks)
    with admin_channel(daemon) as ch:
        admin_pb2_grpc.AdminStub(ch).EvictSession(
            admin_pb2.EvictSessionRequest(session_id=s.id, reason="test"), timeout=5
        )
    with tidalpool.attach(daemon.socket_dir, device_limit="4MiB", job_name="next") as nxt:
        assert list(status.fetch(daemon.socket_dir)[1].sessions[0].lease.device.chunks) == chunks
        assert not s.device.retired  # the evicted client has not let go of its mapping
        stale[:] = b"\xee" * (4 * MiB)
        fresh = nxt.malloc(4 * MiB)
        assert bytes(nxt.buffer(fresh)) == bytes(4 * MiB)
    s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_peer_with_another_uid_is_refused(start_daemon: StartDaemon) -> None:
    d = start_daemon("--socket-mode", "0666")
    os.chmod(d.socket_dir, 0o755)
    code = (
        "import os, sys, pathlib\n"
        "from tidalclient.handles import request_lease\n"
        "from tidalclient.errors import AttachError\n"
        "os.setgid(65534); os.setgroups([]); os.setuid(65534)  # after the imports: /root is 0700\n"
        "try:\n"
        f"    request_lease(pathlib.Path({str(d.socket_dir / 'handles.sock')!r}), 0, 0, 'x',\n"
        f"                  daemon_users={str(os.getuid())!r})  # the daemon's uid: trusted\n"
        "except AttachError as e:\n"
        "    print(e); sys.exit(0)\n"
        "sys.exit('admitted')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "PERMISSION_DENIED" in out.stdout
    assert "uid 65534" in out.stdout
    assert status.fetch(d.socket_dir)[0].device.leased_bytes == 0


def spawn_worker(d: LocalDaemon, seed: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(d.socket_dir), str(seed)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[0] == "ready", line
    return proc, line[1]


def ask(proc: subprocess.Popen[str], command: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_session_info_is_complete(daemon: LocalDaemon) -> None:
    with tidalpool.attach(daemon.socket_dir, job_name="info") as s:
        _, sessions = status.fetch(daemon.socket_dir)
        (info,) = sessions.sessions
        assert isinstance(info, common_pb2.SessionInfo)
        assert (info.session_id, info.pid, info.uid, info.state) == (
            s.id,
            os.getpid(),
            os.getuid(),
            "attached",
        )


@pytest.mark.parametrize("gbps", [1e-300, -1.0, float("nan"), float("inf"), 1e7])
def test_a_copy_bandwidth_outside_any_link_is_refused_at_attach(
    daemon: LocalDaemon, gbps: float
) -> None:
    """The planner simulates swaps at the session's bandwidth: one no link has (1e-300 GB/s
    would make every copy last for ages) is refused before it reaches the planner."""
    from tidalclient.handles import request_lease

    grant = request_lease(daemon.socket_dir / "handles.sock", 2 * MiB, 2 * MiB, "odd-link")
    grant.close()
    with channel(daemon) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pool_pb2_grpc.PoolStub(ch).Attach(
                pool_pb2.AttachRequest(swap_limit_bytes=MiB, copy_gbps=gbps),
                metadata=(("tidalpool-token", grant.response.token),),
                timeout=5,
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "copy_gbps must be 0 (not throttled) or a bandwidth from 0.001 to 1e+06 GB/s" in (
            e.value.details()
        )
        attached = pool_pb2_grpc.PoolStub(ch).Attach(  # the session may still attach
            pool_pb2.AttachRequest(swap_limit_bytes=MiB, copy_gbps=12.0),
            metadata=(("tidalpool-token", grant.response.token),),
            timeout=5,
        )
    assert attached.session_id == grant.response.session_id
