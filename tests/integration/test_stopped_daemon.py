"""A daemon that stops reading (SIGSTOP): the job's trace does not pile up in its memory."""

from __future__ import annotations

import signal
import time

import pytest
import tidalpool
from tidalcore.events import ALLOC

from ..conftest import StartDaemon

BOUND = 100_000  # trace events a session may have sent and the stream not taken
MOST = 4_000_000  # events recorded at most before the test gives up on the recorder stopping


def test_a_stopped_daemon_stops_the_trace_and_the_job_goes_on(
    start_daemon: StartDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    d = start_daemon()
    s = tidalpool.attach(d.socket_dir, device_limit=4 << 20)
    s.recorder.max_backlog_events = BOUND
    d.process.send_signal(signal.SIGSTOP)
    try:
        with caplog.at_level("WARNING", logger="tidalpool"):
            recorded = 0
            while not s.recorder.stopped and recorded < MOST:  # a state, not a time
                for k in range(10_000):
                    s.recorder.record(ALLOC, k, 64)
                recorded += 10_000
                s.recorder.flush()
        assert s.recorder.stopped, f"{recorded} events recorded and the trace still sent"
        # What waits for the stream is bounded: the events queued, not all that were recorded.
        assert s.connection.backlog_events() <= BOUND
        assert s.recorder.events_sent + s.recorder.events_dropped == recorded
        assert any("stops sending its trace" in m for m in caplog.messages)
        block = s.malloc(4096)  # the job goes on: allocation is local
        s.free(block)
    finally:
        d.process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while s.connection.backlog_events() and time.monotonic() < deadline:
        time.sleep(0.01)  # the daemon, running again, reads what was queued
    s.close()
    assert s.recorder.events_dropped > 0
