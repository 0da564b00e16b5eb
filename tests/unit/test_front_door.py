"""The front door alone, before an echo server: what it relays, whom it keeps waiting, whom it
closes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidalpoold.front import PREFACE, FrontDoor

from tests.flood import hold

WAIT_S = 30.0  # for a state, on a busy machine


@pytest.fixture
def echo(short_dir: Path) -> Iterator[Path]:
    """A server at a socket that sends back whatever it receives, and ends its side when the
    peer ends its own."""
    path = short_dir / "echo.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(16)

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield path
    server.close()


def door(short_dir: Path, echo: Path, **kw: float) -> FrontDoor:
    args = {"places": 4, "waiting": 3, "reserved": 1, "handshake_s": 5.0, "quiet_s": 10.0, **kw}
    front = FrontDoor(short_dir / "front.sock", echo, 0o600, **args)  # type: ignore[arg-type]
    front.start()
    return front


def connect(front: FrontDoor) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX)
    conn.settimeout(WAIT_S)
    conn.connect(str(front.path))
    return conn


def closed(conn: socket.socket) -> bool:
    """True once the other end has closed (what it sent before is read and dropped; a socket
    timeout if it does not); `conn` is closed too."""
    with conn:
        try:
            while conn.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
    return True


def until(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_bytes_go_both_ways_whole_and_an_end_is_passed_on(short_dir: Path, echo: Path) -> None:
    front = door(short_dir, echo)
    try:
        conn = connect(front)
        payload = os.urandom(8 << 20)  # many reads' worth: back-pressure both ways
        sender = threading.Thread(target=lambda: (conn.sendall(PREFACE + payload),))
        sender.start()
        got = bytearray()
        while len(got) < len(PREFACE) + len(payload):
            got += conn.recv(1 << 20)
        sender.join()
        assert bytes(got) == PREFACE + payload
        assert front.counts() == {"waiting": 0, "relayed": 1, "refused": 0}
        conn.shutdown(socket.SHUT_WR)  # the echo server ends its side in turn
        assert conn.recv(1) == b""
        conn.close()
        until(lambda: front.counts()["relayed"] == 0, "the pair is closed")
    finally:
        front.close()


def test_what_is_not_http2_is_closed_and_a_silent_peer_at_its_deadline(
    short_dir: Path, echo: Path
) -> None:
    front = door(short_dir, echo, handshake_s=0.2)
    try:
        wrong = connect(front)
        wrong.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert closed(wrong)
        silent = connect(front)
        started = time.monotonic()
        assert closed(silent)
        assert time.monotonic() - started >= 0.2
        assert front.counts() == {"waiting": 0, "relayed": 0, "refused": 2}
    finally:
        front.close()


def test_the_process_holding_the_most_waiting_loses_its_oldest(short_dir: Path, echo: Path) -> None:
    front = door(short_dir, echo, places=8, reserved=1)
    relayed = []  # ours, passed on: they no longer count in the waiting room
    for _ in range(3):
        conn = connect(front)
        conn.sendall(PREFACE)
        assert conn.recv(len(PREFACE)) == PREFACE
        relayed.append(conn)
    # Another process holds the whole waiting room (3), silent.
    hold = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys\n"
            "cs = [socket.socket(socket.AF_UNIX) for _ in range(3)]\n"
            "for c in cs:\n"
            "    c.connect(sys.argv[1]); print('in', flush=True)\n"
            "for c in cs:\n"
            "    c.settimeout(60); print(c.recv(1) == b'', flush=True)\n",
            str(front.path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hold.stdout is not None
        for _ in range(3):
            assert hold.stdout.readline() == "in\n"
        until(lambda: front.counts()["waiting"] == 3, "the three wait")
        ours = connect(front)  # one more: the other process's oldest goes, not ours
        assert hold.stdout.readline() == "True\n"
        ours.sendall(PREFACE)
        assert ours.recv(len(PREFACE)) == PREFACE  # relayed
        assert front.counts() == {"waiting": 2, "relayed": 4, "refused": 1}
        for conn in [ours, *relayed]:
            conn.close()
    finally:
        hold.kill()
        hold.communicate()
        front.close()


def test_one_uid_keeps_all_places_but_the_reserved_ones(short_dir: Path, echo: Path) -> None:
    front = door(short_dir, echo, places=4, reserved=1, waiting=8)
    try:
        held = []
        for _ in range(3):  # all but the reserved one
            conn = connect(front)
            conn.sendall(PREFACE)
            assert conn.recv(len(PREFACE)) == PREFACE
            held.append(conn)
        fourth = connect(front)
        fourth.sendall(PREFACE)
        assert closed(fourth)  # the last place is another uid's to take
        assert front.counts() == {"waiting": 0, "relayed": 3, "refused": 1}
        held.pop().close()
        until(lambda: front.counts()["relayed"] == 2, "a place is free")
        fifth = connect(front)
        fifth.sendall(PREFACE)
        assert fifth.recv(len(PREFACE)) == PREFACE
        for conn in [*held, fifth]:
            conn.close()
    finally:
        front.close()


def test_settings_out_of_range_are_refused(short_dir: Path, echo: Path) -> None:
    with pytest.raises(ValueError, match="reserved < places"):
        door(short_dir, echo, places=2, waiting=1, reserved=2)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to other uids needs root")
@pytest.mark.parametrize("quiet_s", [0.0, 3600.0])
def test_with_every_place_held_a_lighter_uid_takes_a_quiet_place_of_the_heaviest(
    short_dir: Path, echo: Path, quiet_s: float
) -> None:
    """Two uids hold every place (65534 three, this one the fourth): a third uid's connection
    takes the place of one of 65534's once it has been quiet `quiet_s` (0: at once), and is
    refused while none has (an hour); this uid's connection, not the heaviest's, is kept."""
    os.chmod(short_dir, 0o755)
    front = FrontDoor(
        short_dir / "front.sock",
        echo,
        0o666,
        places=4,
        waiting=8,
        reserved=1,
        handshake_s=5.0,
        quiet_s=quiet_s,
    )
    front.start()
    holders = []
    try:
        heavy, kept = hold(str(front.path), 65534, 4, PREFACE)
        holders.append(heavy)
        assert kept == 3  # all but the reserved place
        mine = connect(front)
        mine.sendall(PREFACE)
        assert mine.recv(len(PREFACE)) == PREFACE
        assert front.counts() == {"waiting": 0, "relayed": 4, "refused": 1}
        light, kept = hold(str(front.path), 65533, 1, PREFACE)
        holders.append(light)
        assert kept == (1 if quiet_s == 0 else 0)
        assert front.counts() == {"waiting": 0, "relayed": 4, "refused": 2}
        mine.sendall(b"still here")
        assert mine.recv(10) == b"still here"
        mine.close()
    finally:
        for process in holders:
            process.kill()
            process.communicate()
        front.close()
