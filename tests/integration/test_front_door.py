"""tidalpool.sock's front door: one process's flood of silent connections never costs another
process its place, and one uid never holds the places the others are left."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
import tidalpool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tidalclient.connection import RECONNECT
from tidalclient.local import LocalDaemon
from tidalpoold.front import PREFACE
from tidalpoold.server import (
    CONNECTIONS_PER_SESSION,
    RESERVED_CONNECTIONS,
    SPARE_CONNECTIONS,
)

from tests.conftest import StartDaemon
from tests.flood import NOBODY, SETTINGS_FRAME, flood, hold

WAIT_S = 60.0  # for a state, on a busy machine


def health_on_jobs_socket(socket_dir: Path, wait_for_ready: bool = True) -> bool:
    """Whether tidalpool.sock itself (not admin.sock, as the probes) answers a health check:
    asked as a session's channel asks (`wait_for_ready`: connecting again while the socket's
    backlog is full), else once (a connection refused fails it at once)."""
    path = f"unix:{socket_dir / 'tidalpool.sock'}"
    with grpc.insecure_channel(path, options=RECONNECT) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=wait_for_ready
            )
        except grpc.RpcError:
            if wait_for_ready:
                raise
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_flood_of_silent_connections_from_one_process_does_not_keep_others_out(
    daemon: LocalDaemon,
) -> None:
    with flood(str(daemon.socket_dir / "tidalpool.sock"), 1000) as about:
        # Asked once each, checks get through: the flood's connections never take the
        # bystander's place (before the front door all of them were refused, the flood
        # holding every place the gRPC server had). Not every one need: on a loaded machine
        # the flood can fill the socket's backlog faster than the daemon accepts.
        assert any(
            health_on_jobs_socket(daemon.socket_dir, wait_for_ready=False) for _ in range(10)
        )
        assert health_on_jobs_socket(daemon.socket_dir)
        with tidalpool.attach(daemon.socket_dir, device_limit=2 << 20) as s:
            s.free(s.malloc(4096))
    assert about["closed_by_daemon"] > 0  # it was refused as it went on


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_one_uid_holds_at_most_its_share_of_the_places(start_daemon: StartDaemon) -> None:
    sessions = 4
    d = start_daemon("--socket-mode", "0666", "--max-sessions", str(sessions))
    os.chmod(d.socket_dir, 0o755)
    places = CONNECTIONS_PER_SESSION * sessions + SPARE_CONNECTIONS
    share = places - RESERVED_CONNECTIONS
    jobs = str(d.socket_dir / "tidalpool.sock")
    holder, kept = hold(jobs, NOBODY, places, PREFACE + SETTINGS_FRAME)
    try:
        assert kept == share  # the rest were closed at their preface
        started = time.monotonic()
        assert health_on_jobs_socket(d.socket_dir)
        with tidalpool.attach(d.socket_dir, device_limit=2 << 20) as s:  # the daemon's uid
            s.free(s.malloc(4096))
        assert time.monotonic() - started < WAIT_S
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.communicate()
