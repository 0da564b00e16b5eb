"""The metrics endpoint under idle connections: a bounded number of threads and open files in
the daemon, idle connections closed, and a scrape served again once they are gone."""

from __future__ import annotations

import os
import socket
import time
import urllib.request

from tidalpoold.metrics import METRICS_CONNECTIONS, METRICS_IDLE_S

from tools.prometheus import metrics_address

from ..conftest import StartDaemon

IDLE = 300  # idle connections opened: many more than the endpoint serves at once
WAIT_S = METRICS_IDLE_S + 30.0  # for a state, on a busy machine


def threads_and_fds(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as status:
        threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_peer(conn: socket.socket) -> bool:
    """Whether the daemon has closed `conn` (EOF or a reset), without waiting."""
    conn.setblocking(False)
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset: closed too
        return True


def test_idle_connections_hold_bounded_threads_and_are_closed(start_daemon: StartDaemon) -> None:
    d = start_daemon("--metrics-address", "127.0.0.1:0", "--log-format", "json")
    host, port = metrics_address(d.log_path).rsplit(":", 1)
    pid = d.process.pid
    threads0, fds0 = threads_and_fds(pid)
    conns = []
    try:
        for _ in range(IDLE):
            conns.append(socket.create_connection((host, int(port)), timeout=10))
        # The daemon has taken them all: those past the cap are closed at once.
        deadline = time.monotonic() + WAIT_S
        while sum(closed_by_peer(c) for c in conns) < IDLE - METRICS_CONNECTIONS:
            assert time.monotonic() < deadline, "connections past the cap not closed"
            time.sleep(0.05)
        threads, fds = threads_and_fds(pid)
        assert threads <= threads0 + METRICS_CONNECTIONS, (threads0, threads)
        assert fds <= fds0 + METRICS_CONNECTIONS + 8, (fds0, fds)
        # The idle ones within the cap are closed once idle for METRICS_IDLE_S.
        while not all(closed_by_peer(c) for c in conns):
            assert time.monotonic() < deadline, "idle connections left open"
            time.sleep(0.1)
    finally:
        for c in conns:
            c.close()
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200 and b"tidalpool_pool_bytes" in reply.read()
    deadline = time.monotonic() + WAIT_S
    while threads_and_fds(pid)[0] > threads0:  # their threads are gone too
        assert time.monotonic() < deadline, "metrics threads left behind"
        time.sleep(0.05)
