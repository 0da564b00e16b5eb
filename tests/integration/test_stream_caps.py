"""Streams anyone may open (Health/Watch, server reflection: no token needed) cannot take the
workers that health checks and attaches need: past a few of each, they are refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import tidalpool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tidalclient.local import LocalDaemon
from tidalpoold.server import REFLECTIONS, SPARE_WORKERS, WATCHES

ATTEMPTS = 5 * SPARE_WORKERS  # more streams than the server has spare workers
WAIT_S = 30.0  # for a state on a busy machine


def open_watches(
    channel: grpc.Channel, n: int
) -> tuple[list[Iterator[object]], list[grpc.RpcError]]:
    """`n` Health/Watch streams: those served (their first answer read) and those refused."""
    stub = health_pb2_grpc.HealthStub(channel)
    served: list[Iterator[object]] = []
    refused: list[grpc.RpcError] = []
    for _ in range(n):
        stream = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        try:
            first = next(stream)
        except grpc.RpcError as e:
            refused.append(e)
        else:
            assert first.status == health_pb2.HealthCheckResponse.SERVING  # type: ignore[attr-defined]
            served.append(stream)
    return served, refused


def test_watch_streams_past_the_cap_are_refused_and_health_and_attach_still_answer(
    daemon: LocalDaemon,
) -> None:
    with grpc.insecure_channel(f"unix:{daemon.socket_dir / 'tidalpool.sock'}") as channel:
        served, refused = open_watches(channel, ATTEMPTS)
        try:
            assert len(served) == WATCHES and len(refused) == ATTEMPTS - WATCHES
            e = refused[0]
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"Health/Watch: {WATCHES} streams are open" in str(e.details())
            # With those held, a health check and an attach are served at once.
            health = health_pb2_grpc.HealthStub(channel)
            started = time.monotonic()
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with tidalpool.attach(daemon.socket_dir, device_limit=2 << 20) as s:
                s.free(s.malloc(4096))
            assert time.monotonic() - started < 10
        finally:
            for stream in served:
                stream.cancel()  # type: ignore[attr-defined]
        # Their slots come back: a new Watch is served again.
        deadline = time.monotonic() + WAIT_S
        while True:
            again, _ = open_watches(channel, 1)
            if again:
                again[0].cancel()  # type: ignore[attr-defined]
                break
            assert time.monotonic() < deadline, "no Watch served after the others closed"
            time.sleep(0.05)


def test_reflection_streams_past_the_cap_are_refused(daemon: LocalDaemon) -> None:
    hold = threading.Event()

    def requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        hold.wait(WAIT_S)  # the stream stays open until the test lets it go

    with grpc.insecure_channel(f"unix:{daemon.socket_dir / 'tidalpool.sock'}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        streams = []
        try:
            for _ in range(REFLECTIONS):
                stream = stub.ServerReflectionInfo(requests())
                assert next(stream).list_services_response.service  # served, and still open
                streams.append(stream)
            extra = stub.ServerReflectionInfo(requests())
            with pytest.raises(grpc.RpcError) as e:
                next(extra)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "ServerReflectionInfo" in str(e.value.details())
        finally:
            hold.set()
            for stream in streams:
                stream.cancel()
