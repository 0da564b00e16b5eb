"""The health check's answers, against an in-process gRPC health service on a Unix socket (the
real daemon's answers are in tests/integration/test_health.py)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tidalclient.health import Health, check


@pytest.fixture
def servicer(short_dir: Path) -> Iterator[health.HealthServicer]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{short_dir / 'tidalpool.sock'}")
    server.start()
    yield servicer
    server.stop(None).wait()


def test_serving(short_dir: Path, servicer: health.HealthServicer) -> None:
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("tidalpool.v1.Pool", health_pb2.HealthCheckResponse.SERVING)
    path = short_dir / "tidalpool.sock"
    assert check(short_dir) == Health(True, f"serving: the daemon at {path}")
    assert check(short_dir, "tidalpool.v1.Pool") == Health(
        True, f"serving: service tidalpool.v1.Pool at {path}"
    )


def test_shutting_down_is_not_serving(short_dir: Path, servicer: health.HealthServicer) -> None:
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.enter_graceful_shutdown()  # what the daemon does first when it stops
    path = short_dir / "tidalpool.sock"
    assert check(short_dir) == Health(False, f"not serving: the daemon at {path} is NOT_SERVING")


def test_an_unknown_service(short_dir: Path, servicer: health.HealthServicer) -> None:
    path = short_dir / "tidalpool.sock"
    assert check(short_dir, "tidalpool.v1.Nope") == Health(
        False, f"the daemon at {path} has no service 'tidalpool.v1.Nope'"
    )


def test_no_socket(short_dir: Path) -> None:
    path = short_dir / "tidalpool.sock"
    assert check(short_dir) == Health(False, f"no daemon at {short_dir}: {path} does not exist")


def test_a_socket_nobody_listens_on(short_dir: Path) -> None:
    path = short_dir / "tidalpool.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # bound, never listening: what a daemon killed with -9 leaves
    answer = check(short_dir)
    assert not answer.serving
    assert answer.message.startswith(f"no daemon answers at {path}: "), answer.message
    assert "Connection refused" in answer.message


def test_a_socket_that_never_answers(short_dir: Path) -> None:
    path = short_dir / "tidalpool.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen()  # connections queue, and nothing ever speaks gRPC on them
        assert check(short_dir, timeout=0.3) == Health(False, f"no answer from {path} within 0.3 s")


def test_the_daemon_is_asked_on_admin_sock_when_this_process_may_connect_to_it(
    short_dir: Path, servicer: health.HealthServicer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe (the daemon's uid) asks on admin.sock, apart from the jobs' socket; a process
    that may not connect to admin.sock (a job's uid) asks on tidalpool.sock."""
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    admin_server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    admin_servicer = health.HealthServicer()
    admin_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # tells them apart
    health_pb2_grpc.add_HealthServicer_to_server(admin_servicer, admin_server)
    admin = short_dir / "admin.sock"
    admin_server.add_insecure_port(f"unix:{admin}")
    admin_server.start()
    try:
        assert check(short_dir) == Health(
            False, f"not serving: the daemon at {admin} is NOT_SERVING"
        )
        monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != admin)
        jobs = short_dir / "tidalpool.sock"
        assert check(short_dir) == Health(True, f"serving: the daemon at {jobs}")
    finally:
        admin_server.stop(None).wait()
