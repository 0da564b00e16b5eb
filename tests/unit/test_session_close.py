"""A closing session's trace: the recorder hands over everything it holds, and the connection
waits until the daemon says it has every event (its Stats) before Detach, or warns once with the
number it lacks. The daemon here is a stub answering Stats."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tidalclient.connection import Connection
from tidalclient.recorder import Recorder
from tidalcore.events import ALLOC, FREE
from tidalcore.v1 import common_pb2, pool_pb2

LOGGER = "tidalpool"


class Unavailable(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class Daemon:
    """Stats answers: the events and step marks it has taken in, moving on by `per_call` after
    each answer (the reader catching up)."""

    def __init__(self, events: int = 0, steps: int = 0, per_call: tuple[int, int] = (0, 0)):
        self.events, self.steps, self.per_call = events, steps, per_call
        self.calls = 0
        self.down = False

    def Stats(  # the gRPC method's name
        self, request: pool_pb2.StatsRequest, metadata: object, timeout: float
    ) -> pool_pb2.StatsResponse:
        self.calls += 1
        if self.down:
            raise Unavailable()
        info = common_pb2.SessionInfo(events_received=self.events, iterations_seen=self.steps)
        self.events += self.per_call[0]
        self.steps += self.per_call[1]
        return pool_pb2.StatsResponse(session=info)


@pytest.fixture
def connection() -> Iterator[Connection]:
    c = Connection(Path("/nonexistent"), "s-test", "token")  # the channel is never used
    yield c
    c.close()


def trace(n: int) -> pool_pb2.ClientMessage:
    return pool_pb2.ClientMessage(trace=pool_pb2.TraceChunk(kinds=[pool_pb2.EVENT_KIND_ALLOC] * n))


def take_all(connection: Connection, taken: list[pool_pb2.ClientMessage]) -> threading.Thread:
    """The stream's side: a thread that takes the outbox's messages as gRPC does."""
    thread = threading.Thread(target=lambda: taken.extend(connection._outgoing()), daemon=True)
    thread.start()
    return thread


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_flush_returns_once_the_daemon_has_every_event_and_step(
    connection: Connection, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = Daemon(events=0, steps=2, per_call=(4096, 0))
    monkeypatch.setattr(connection, "_stub", daemon)
    taken: list[pool_pb2.ClientMessage] = []
    for n in (4096, 4096, 1808):
        connection.send(trace(n))
    stream = take_all(connection, taken)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert connection.flush(10_000, 2, timeout_s=60) == 12_288
    assert [len(m.trace.kinds) for m in taken] == [4096, 4096, 1808]  # all handed over first
    assert daemon.calls == 4  # 0, 4096, 8192: short; 12288: enough
    assert warnings_of(caplog) == []
    connection.close()
    stream.join(timeout=30)


def test_flush_waits_for_step_marks_too(
    connection: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = Daemon(events=100, steps=0, per_call=(0, 1))
    monkeypatch.setattr(connection, "_stub", daemon)
    assert connection.flush(100, 3, timeout_s=60) == 100
    assert daemon.calls == 4  # the events were there at once; the third mark at the fourth


def test_a_session_with_no_trace_asks_nothing(
    connection: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = Daemon()
    monkeypatch.setattr(connection, "_stub", daemon)
    assert connection.flush(0, 0, timeout_s=60) == 0
    assert daemon.calls == 0


def test_a_daemon_that_falls_short_gets_one_warning_with_the_count(
    connection: Connection, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = Daemon(events=6865)
    monkeypatch.setattr(connection, "_stub", daemon)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert connection.flush(40_000, 0, timeout_s=0.2) == 6865
    assert daemon.calls >= 2  # it asked again until the deadline
    assert warnings_of(caplog) == [
        "tidalpool: session s-test detaches with 33135 of its 40000 trace events not delivered"
        " to the daemon (waited 0.2 s)"
    ]


def test_a_stream_that_takes_nothing_waits_the_deadline_then_warns(
    connection: Connection, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = Daemon(events=1000)
    monkeypatch.setattr(connection, "_stub", daemon)
    connection.send(trace(1000))  # nobody takes it: the stream is stuck
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert connection.flush(1000, 0, timeout_s=0.2) == -1
    assert daemon.calls == 0  # the deadline passed before the outbox was taken
    assert warnings_of(caplog) == [
        "tidalpool: session s-test detaches with 1000 of its 1000 trace events not delivered"
        " to the daemon (waited 0.2 s)"
    ]


def test_a_daemon_that_does_not_answer_confirms_nothing(
    connection: Connection, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = Daemon()
    daemon.down = True
    monkeypatch.setattr(connection, "_stub", daemon)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert connection.flush(500, 0, timeout_s=60) == -1
    assert daemon.calls == 1  # no retries against a daemon that is gone
    assert warnings_of(caplog) == [
        "tidalpool: session s-test detaches with 500 of its 500 trace events not delivered"
        " to the daemon (it did not answer: UNAVAILABLE)"
    ]


def test_a_goodbye_stops_the_wait_without_a_warning(
    connection: Connection, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(connection, "_stub", Daemon())
    connection.send(trace(10))  # never taken
    goodbye = pool_pb2.Goodbye(reason=pool_pb2.Goodbye.REASON_EVICTED, message="test")
    bye = threading.Timer(0.05, connection._end, args=(goodbye,))
    bye.start()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert connection.flush(10, 0, timeout_s=600) == -1  # returns at the goodbye
    assert connection.ended
    assert warnings_of(caplog) == []  # the daemon ended the session: nothing waits for it
    bye.join()


def test_recorder_close_hands_over_the_pending_chunks_and_marks() -> None:
    sent: list[pool_pb2.ClientMessage] = []
    recorder = Recorder(sent.append, chunk_events=4, period_s=3600)  # drains at close only
    for block in range(3):
        recorder.record(ALLOC, block, 64)
    recorder.record(FREE, 0)
    recorder.step(1)  # the fifth event, and the mark after it
    recorder.close()
    assert [m.WhichOneof("body") for m in sent] == ["trace", "trace", "step"]
    assert [len(m.trace.kinds) for m in sent[:2]] == [4, 1]
    assert sent[2].step == pool_pb2.StepMark(iteration=1, events_before=5)
    assert (recorder.events_sent, recorder.steps_sent) == (5, 1)
