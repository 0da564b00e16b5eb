"""The health check's answers, against an in-process gRPC health service on a Unix socket (the
real daemon's answers are in tests/integration/test_health.py)."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tidalclient.health import Health, check


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: keep the directory short.
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as directory:
        yield Path(directory)


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
