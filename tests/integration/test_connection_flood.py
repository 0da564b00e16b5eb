"""Connections to tidalpool.sock that never finish their HTTP/2 handshake: the daemon holds at
most its cap of them, drops them after the handshake timeout, and its probes (on admin.sock)
answer throughout."""

from __future__ import annotations

import os
import socket
import time

import tidalpool
from tidalclient.health import check
from tidalclient.local import LocalDaemon
from tidalpoold.server import CONNECTIONS_PER_SESSION, HANDSHAKE_S, SPARE_CONNECTIONS

FLOOD = 600  # connections that say nothing
MAX_SESSIONS = 64  # the daemon's default
WAIT_S = HANDSHAKE_S + 30.0  # for a state, on a busy machine


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_flood_of_silent_connections_is_bounded_and_probes_still_answer(
    daemon: LocalDaemon,
) -> None:
    pid = daemon.process.pid
    before = fds(pid)
    cap = CONNECTIONS_PER_SESSION * MAX_SESSIONS + SPARE_CONNECTIONS
    flood = []
    try:
        for _ in range(FLOOD):
            conn = socket.socket(socket.AF_UNIX)
            conn.settimeout(10)
            conn.connect(str(daemon.socket_dir / "tidalpool.sock"))
            flood.append(conn)
        assert fds(pid) <= before + cap + 16  # never one fd per connection past the cap
        started = time.monotonic()
        health = check(daemon.socket_dir, timeout=5)
        assert health.serving and "admin.sock" in health.message, health
        assert time.monotonic() - started < 1.0
        # Silent past the handshake timeout: the daemon lets them go.
        deadline = time.monotonic() + WAIT_S
        while fds(pid) > before + 4:
            assert time.monotonic() < deadline, f"{fds(pid)} fds, {before} before the flood"
            time.sleep(0.1)
    finally:
        for conn in flood:
            conn.close()
    with tidalpool.attach(daemon.socket_dir, device_limit=2 << 20) as s:  # jobs attach again
        s.free(s.malloc(4096))
