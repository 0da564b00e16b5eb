"""Structured logs: exact JSON fields, exact text lines, levels, one line per event."""

from __future__ import annotations

import io
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidalpoold.log import configure

CREATED = 1_700_000_000.25  # a fixed LogRecord.created, so that timestamps are exact


class FixedClock(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.created = CREATED
        return True


@pytest.fixture(autouse=True)
def restore_logger() -> Iterator[None]:
    """configure() rewires the "tidalpoold" logger: put it back as it was."""
    saved = []
    for name in ("tidalpoold",):
        root = logging.getLogger(name)
        saved.append((root, root.handlers[:], root.level, root.propagate))
    yield
    for root, handlers, level, propagate in saved:
        root.handlers[:] = handlers
        root.setLevel(level)  # not `root.level =`: setLevel also clears the level caches
        root.propagate = propagate


@pytest.fixture
def log() -> Iterator[logging.Logger]:
    """A child of "tidalpoold" whose records all carry CREATED."""
    logger = logging.getLogger("tidalpoold.sessions")
    clock = FixedClock()
    logger.addFilter(clock)
    yield logger
    logger.removeFilter(clock)


def lines(stream: io.StringIO) -> list[str]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return text[:-1].split("\n")


STAMP = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(CREATED))


# -- JSON ------------------------------------------------------------------------------------------


def test_json_line_has_exact_fields(log: logging.Logger) -> None:
    stream = io.StringIO()
    configure("json", "info", stream)
    log.info("session.attached", extra={"session": "s-1", "pid": 42, "lease_bytes": 1 << 30})
    [line] = lines(stream)
    assert json.loads(line) == {
        "ts": 1700000000.25,
        "level": "info",
        "logger": "tidalpoold.sessions",
        "event": "session.attached",
        "session": "s-1",
        "pid": 42,
        "lease_bytes": 1073741824,
    }


def test_json_without_extra_fields(log: logging.Logger) -> None:
    stream = io.StringIO()
    configure("json", "debug", stream)
    log.debug("pool.%s", "ready")
    assert [json.loads(line) for line in lines(stream)] == [
        {"ts": CREATED, "level": "debug", "logger": "tidalpoold.sessions", "event": "pool.ready"}
    ]


def test_json_turns_other_values_into_strings(log: logging.Logger) -> None:
    stream = io.StringIO()
    configure("json", "info", stream)
    log.warning("socket.bound", extra={"path": Path("/run/tidalpool/x.sock"), "gids": (0, 5)})
    fields = json.loads(lines(stream)[0])
    assert fields["path"] == "/run/tidalpool/x.sock"
    assert fields["gids"] == [0, 5]
    assert fields["level"] == "warning"


def test_json_keeps_one_line_per_event_even_with_newlines(log: logging.Logger) -> None:
    stream = io.StringIO()
    configure("json", "info", stream)
    log.info("a", extra={"why": "two\nlines"})
    log.error("b")
    log.info("c", extra={"n": 3})
    assert [json.loads(line)["event"] for line in lines(stream)] == ["a", "b", "c"]
    assert json.loads(lines(stream)[0])["why"] == "two\nlines"


def test_json_exception(log: logging.Logger) -> None:
    stream = io.StringIO()
    configure("json", "info", stream)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("request.failed", extra={"rpc": "Attach"})
    [line] = lines(stream)
    fields = json.loads(line)
    assert set(fields) == {"ts", "level", "logger", "event", "rpc", "exception"}
    assert fields["level"] == "error"
    assert fields["event"] == "request.failed"
    assert fields["rpc"] == "Attach"
    assert fields["exception"].startswith("Traceback (most recent call last):\n")
    assert fields["exception"].endswith("\nValueError: boom")


# -- text ------------------------------------------------------------------------------------------


def test_text_line_is_exact(log: logging.Logger) -> None:
    stream = io.StringIO()
    configure("text", "info", stream)
    log.info("session.attached", extra={"session": "s-1", "pid": 42})
    assert lines(stream) == [f"{STAMP} info    session.attached session=s-1 pid=42"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", STAMP)


def test_text_without_fields_has_no_trailing_space(log: logging.Logger) -> None:
    stream = io.StringIO()
    configure("text", "info", stream)
    log.warning("shutdown")
    log.error("gone")
    assert lines(stream) == [f"{STAMP} warning shutdown", f"{STAMP} error   gone"]


def test_text_is_the_default_for_other_formats(log: logging.Logger) -> None:
    stream = io.StringIO()
    configure("anything", "info", stream)
    log.info("x", extra={"k": "v"})
    assert lines(stream) == [f"{STAMP} info    x k=v"]


def test_text_one_line_per_event(log: logging.Logger) -> None:
    stream = io.StringIO()
    configure("text", "info", stream)
    for i in range(3):
        log.info("tick", extra={"i": i})
    assert lines(stream) == [f"{STAMP} info    tick i={i}" for i in range(3)]


# -- levels and wiring -----------------------------------------------------------------------------


def test_level_filters_events(log: logging.Logger) -> None:
    stream = io.StringIO()
    configure("json", "WARNING", stream)
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    assert [json.loads(line)["event"] for line in lines(stream)] == ["w", "e"]
    assert logging.getLogger("tidalpoold").level == logging.WARNING


def test_configure_replaces_handlers_and_stops_propagation(log: logging.Logger) -> None:
    first, second = io.StringIO(), io.StringIO()
    configure("json", "info", first)
    configure("text", "info", second)
    root = logging.getLogger("tidalpoold")
    assert len(root.handlers) == 1
    assert root.propagate is False
    log.info("only.second")
    assert first.getvalue() == ""
    assert lines(second) == [f"{STAMP} info    only.second"]


def test_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError) as e:
        configure("json", "loud", io.StringIO())
    assert str(e.value) == "Unknown level: 'LOUD'"
