"""The notify protocol: one datagram to a path or an abstract `@name`; nothing without one."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest
from tidalpoold.notify import Notifier


def listener(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(5)
    return s


def test_a_datagram_to_a_socket_path(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with listener(path) as s:
        assert Notifier(path).send("READY=1", "STATUS=serving\nGPU 0")
        assert s.recv(4096) == b"READY=1\nSTATUS=serving GPU 0"


def test_a_datagram_to_an_abstract_socket() -> None:
    name = f"tidalpool-test-{os.getpid()}"
    with listener("\0" + name) as s:
        assert Notifier("@" + name).send("STOPPING=1")
        assert s.recv(4096) == b"STOPPING=1"


@pytest.mark.parametrize("address", [None, ""])
def test_without_a_manager_nothing_is_sent(address: str | None) -> None:
    assert Notifier(address).target is None
    assert not Notifier(address).send("READY=1")


def test_an_unsupported_address_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tidalpoold.notify"):
        assert not Notifier("vsock:2:1234").send("READY=1")
    assert [r.getMessage() for r in caplog.records] == ["notify.unsupported"]
    assert "'vsock:2:1234' is neither a path nor @name" in caplog.records[0].__dict__["why"]


def test_a_manager_gone_away_is_a_warning_not_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tidalpoold.notify"):
        assert not Notifier(str(tmp_path / "gone.sock")).send("READY=1")
    assert [r.getMessage() for r in caplog.records] == ["notify.failed"]
    assert "READY=1: [Errno 2] No such file or directory" in caplog.records[0].__dict__["why"]


def test_a_path_that_is_not_utf8_is_sent_escaped(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    odd = os.fsdecode(b"/run/gpu\xff")  # how Python shows such a path: a surrogate escape
    with listener(path) as s:
        assert Notifier(path).send(f"STATUS=serving on {odd}")
        assert s.recv(4096) == b"STATUS=serving on /run/gpu\\udcff"


@pytest.mark.parametrize(
    ("kind", "error"),
    [(socket.SOCK_STREAM, "[Errno 91] Protocol wrong type for socket"), (None, "path too long")],
)
def test_a_socket_that_cannot_take_the_datagram_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: int | None, error: str
) -> None:
    if kind is None:  # longer than a Unix socket address can be
        path = str(tmp_path / ("x" * 120))
        server = None
    else:  # a stream socket where a datagram socket should be
        path = str(tmp_path / "stream.sock")
        server = socket.socket(socket.AF_UNIX, kind)
        server.bind(path)
        server.listen()
    try:
        with caplog.at_level(logging.WARNING, logger="tidalpoold.notify"):
            assert not Notifier(path).send("STOPPING=1")
    finally:
        if server is not None:
            server.close()
    assert [r.getMessage() for r in caplog.records] == ["notify.failed"]
    assert error in caplog.records[0].__dict__["why"]
