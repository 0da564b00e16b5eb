"""A daemon that dies without a word (SIGKILL): the client's SessionClosed says the daemon went
away, not a gRPC status of a stream."""

from __future__ import annotations

import re
import time

import pytest
import tidalpool
from tidalclient.local import LocalDaemon


def wait_closed(s: tidalpool.Session) -> None:
    deadline = time.monotonic() + 30
    while not s.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.closed, "the session never learned its daemon died"


def test_a_killed_daemon_reads_as_gone(daemon: LocalDaemon) -> None:
    s = tidalpool.attach(daemon.socket_dir, device_limit="4MiB", job_name="orphan")
    s.array(16, "uint8")
    daemon.process.kill()
    daemon.process.wait()
    wait_closed(s)
    with pytest.raises(tidalpool.SessionClosed) as caught:
        s.array(16, "uint8")
    message = str(caught.value)
    assert re.fullmatch(
        rf"session {s.id} is over: the daemon went away without ending the session \(killed"
        r" or crashed\?\); its lease is gone",
        message,
    ), message
    s.close()
