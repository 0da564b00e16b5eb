"""A real daemon process and real clients: attach, allocate, trace, detach, reclaim."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import tidalpool
from tidalclient import status
from tidalclient.local import LocalDaemon
from tidalcore.events import OP

from ..conftest import StartDaemon

MiB = 1 << 20


def pool_state(d: LocalDaemon) -> tuple[int, int, int]:
    pool, sessions = status.fetch(d.socket_dir)
    return pool.device.leased_bytes, pool.host.leased_bytes, len(sessions.sessions)


def test_attach_allocate_and_detach_returns_the_lease(daemon: LocalDaemon) -> None:
    assert pool_state(daemon) == (0, 0, 0)
    with tidalpool.attach(
        daemon.socket_dir, device_limit="8MiB", host_limit="4MiB", job_name="t"
    ) as s:
        assert (s.device.length, s.host.length) == (8 * MiB, 4 * MiB)
        assert pool_state(daemon) == (8 * MiB, 4 * MiB, 1)
        a = s.array((256, 256), "float32")
        a[:] = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
        b = s.malloc(1000)
        assert (b.offset, b.size) == (256 * 256 * 4, 1000)
        assert bytes(s.buffer(b)) == bytes(1000)  # a fresh lease reads zeros
        s.buffer(b)[:] = b"\x07" * 1000
        assert a.sum(dtype=np.float64) == sum(range(256 * 256))
        stats = s.stats()
        assert (stats.live_blocks, stats.live_bytes, stats.mallocs) == (2, 256 * 256 * 4 + 1000, 2)
        _, sessions = status.fetch(daemon.socket_dir)
        assert [x.job_name for x in sessions.sessions] == ["t"]
        assert sessions.sessions[0].state == "attached"
    assert pool_state(daemon) == (0, 0, 0)


def test_trace_reaches_the_daemon(daemon: LocalDaemon) -> None:
    with tidalpool.attach(daemon.socket_dir) as s:
        for _ in range(3):
            s.step()
            x = s.array(1024, "float64")
            with s.op(reads=[x], writes=[x], name="scale"):
                x *= 2
            s.release(x)
        stats = s.stats()
        # per iteration: iter, alloc, read, write, op, free
        assert stats.events_recorded == stats.events_sent == 18
        deadline = time.monotonic() + 3  # "sent" is handed to the stream; the daemon follows
        while s.stats().events_received != 18 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.stats().events_received == 18
        _, sessions = status.fetch(daemon.socket_dir)
        assert sessions.sessions[0].iterations_seen == 3


def test_an_op_the_session_cannot_see_is_recorded_with_its_duration(daemon: LocalDaemon) -> None:
    s = tidalpool.attach(daemon.socket_dir)
    sent: list[tuple[int, ...]] = []
    record = s.recorder.record
    s.recorder.record = lambda *event: (sent.append(event), record(*event))  # type: ignore[method-assign]
    s.record_op("forward", 1_500_000)
    (event,) = sent
    assert event == (OP, 0, 0, 1_500_000, s.recorder.name_id("forward"))
    with pytest.raises(ValueError, match="negative time"):
        s.record_op("forward", -1)
    s.close()
    with pytest.raises(tidalpool.SessionClosed):
        s.record_op("forward", 10)


def test_array_is_freed_when_it_and_its_views_are_gone(daemon: LocalDaemon) -> None:
    with tidalpool.attach(daemon.socket_dir) as s:
        a = s.array((4, 4), "int64")
        view = a[1:]
        del a
        assert s.stats().live_blocks == 1  # the view keeps the block
        del view
        assert s.stats().live_blocks == 0


def test_health_and_reflection_are_served(daemon: LocalDaemon) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    # Each socket's health and reflection name what that socket serves: jobs' services on
    # tidalpool.sock, Admin on admin.sock.
    for socket_name, service, other in (
        ("tidalpool.sock", "tidalpool.v1.Pool", "tidalpool.v1.Admin"),
        ("admin.sock", "tidalpool.v1.Admin", "tidalpool.v1.Pool"),
    ):
        with grpc.insecure_channel(f"unix:{daemon.socket_dir / socket_name}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:
                health.Check(health_pb2.HealthCheckRequest(service=other), timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            names = {s.name for r in replies for s in r.list_services_response.service}
        assert {service, "grpc.health.v1.Health"} <= names and other not in names


def test_a_lease_never_attached_is_reclaimed(start_daemon: StartDaemon) -> None:
    from tidalclient.handles import request_lease

    with start_daemon("--attach-timeout-s", "0.5") as d:
        grant = request_lease(d.socket_dir / "handles.sock", 0, 0, "never-attaches")
        grant.close()
        assert pool_state(d)[0] == 64 * MiB
        deadline = time.monotonic() + 3
        while pool_state(d)[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool_state(d) == (0, 0, 0)


def test_sigterm_tells_sessions_and_removes_sockets(daemon: LocalDaemon) -> None:
    s = tidalpool.attach(daemon.socket_dir)
    assert daemon.stop() == 0
    deadline = time.monotonic() + 3
    while not s.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(tidalpool.SessionClosed, match="shutdown"):
        s.malloc(16)
    s.close()
    assert s.device.retired and s.host.retired
    assert not (daemon.socket_dir / "tidalpool.sock").exists()
    assert not (daemon.socket_dir / "handles.sock").exists()
    assert "daemon.stopped" in daemon.log_path.read_text()
