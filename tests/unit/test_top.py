"""`tidalpool top` without a daemon: the rates between two samples, the frame it draws, and
how its loop ends (after N frames, on Ctrl-C, when the daemon goes away)."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console
from tidalclient import status as status_view
from tidalclient import top
from tidalclient.status import Unreachable
from tidalclient.top import Rates, Sample, rates, view
from tidalcore.v1 import admin_pb2, common_pb2

MiB = 1024 * 1024


def session(
    sid: str, out: int = 0, into: int = 0, stall_ns: int = 0, **kw: int
) -> common_pb2.SessionInfo:
    info = common_pb2.SessionInfo(
        session_id=sid,
        job_name=f"job-{sid}",
        pid=100,
        state="attached",
        swapped_out_bytes=out,
        swapped_in_bytes=into,
        swap_stall_ns=stall_ns,
        **kw,
    )
    info.lease.device.length = 64 * MiB
    return info


def pool() -> admin_pb2.PoolStatusResponse:
    p = admin_pb2.PoolStatusResponse(
        backend="sim", mode="memfd", version="9.9", chunk_bytes=2 * MiB
    )
    p.started_unix_ns = time.time_ns() - 12 * 10**9
    p.device.total_bytes, p.device.leased_bytes, p.device.free_bytes = (
        256 * MiB,
        64 * MiB,
        192 * MiB,
    )
    p.host.total_bytes, p.host.free_bytes = 512 * MiB, 512 * MiB
    return p


def draw(now: Sample, before: Sample | None) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=250, color_system=None).print(view(now, before, 0.5))
    return [line.rstrip() for line in out.getvalue().splitlines()]


def cells(lines: list[str], first: str) -> list[str]:
    (row,) = (line for line in lines if line.startswith(first))
    return [c for c in re.split(r"\s{2,}", row) if c]  # columns: two spaces or more apart


def test_rates_are_the_growth_of_the_counts_per_second() -> None:
    before = session("a", out=10 * MiB, into=4 * MiB, stall_ns=100_000_000)
    now = session("a", out=30 * MiB, into=4 * MiB, stall_ns=600_000_000)
    assert rates(before, now, 2.0) == Rates(10 * MiB, 0.0, 0.25)


@pytest.mark.parametrize(
    ("before", "now", "seconds"),
    [(session("a"), session("b"), 1.0), (session("a"), session("a"), 0.0)],
)
def test_no_rates_across_sessions_or_without_time(
    before: common_pb2.SessionInfo, now: common_pb2.SessionInfo, seconds: float
) -> None:
    assert rates(before, now, seconds) is None


def test_a_count_that_went_down_is_no_traffic_and_stall_is_at_most_all_the_time() -> None:
    before = session("a", out=10 * MiB)
    now = session("a", out=MiB, stall_ns=5 * 10**9)
    assert rates(before, now, 1.0) == Rates(0.0, 0.0, 1.0)


def test_the_first_frame_shows_counts_and_the_next_ones_rates() -> None:
    first = Sample(10.0, pool(), (session("a", out=MiB, swap_limit_bytes=8 * MiB),))
    later = Sample(
        12.0,
        pool(),
        (
            session("a", out=5 * MiB, into=2 * MiB, stall_ns=500_000_000, swap_limit_bytes=8 * MiB),
            session("b", out=MiB),  # new since the first frame: no rate yet
        ),
    )
    lines = draw(first, None)
    assert lines[0] == (
        "tidalpoold 9.9 · backend sim (memfd) · chunks of 2 MiB · up 12 s · 1 session(s)"
        " · every 0.5 s · Ctrl-C quits"
    )
    assert cells(lines, "device") == ["device", "256 MiB", "64 MiB", "0 B", "192 MiB", "25 %"]
    assert cells(lines, "host") == ["host", "512 MiB", "0 B", "0 B", "512 MiB", "0 %"]
    assert "swap traffic: measured from the next refresh on" in lines
    assert cells(lines, "a ")[8:] == ["8 MiB", "1 MiB", "0 B", "–", "0"]

    lines = draw(later, first)
    assert "swap traffic: 2 MiB/s out, 1 MiB/s in" in lines
    assert cells(lines, "a ")[8:] == ["8 MiB", "5 MiB (2 MiB/s)", "2 MiB (1 MiB/s)", "25 %", "0"]
    assert cells(lines, "b ")[8:] == ["–", "1 MiB", "0 B", "–", "0"]


def test_no_sessions() -> None:
    assert draw(Sample(1.0, pool(), ()), None)[-1] == "no sessions"


def Gone() -> Unreachable:
    return Unreachable("connection refused")


def replies(*items: object) -> Iterator[object]:
    yield from items


def fake_fetch(items: Iterator[object]) -> top.Fetch:
    def fetch(
        socket_dir: Path,
    ) -> tuple[admin_pb2.PoolStatusResponse, admin_pb2.ListSessionsResponse]:
        item = next(items)
        if isinstance(item, BaseException):
            raise item
        return pool(), admin_pb2.ListSessionsResponse(sessions=[session(str(item))])

    return fetch


def run(*items: object, iterations: int | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = top.run(
        Path("/run/tp"),
        Console(file=out, width=250, color_system=None),
        Console(file=err, width=250, color_system=None),
        interval=0.001,
        iterations=iterations,
        fetch_status=fake_fetch(replies(*items)),
    )
    return status, out.getvalue(), err.getvalue()


def test_it_stops_after_the_frames_asked_for() -> None:
    status, out, err = run("a", "b", "c", "d", iterations=3)
    assert (status, err) == (0, "")
    assert out.count("tidalpoold 9.9") == 3
    rows = [line.split()[0] for line in out.splitlines() if line[:2] in ("a ", "b ", "c ", "d ")]
    assert rows == ["a", "b", "c"]


def test_a_daemon_that_goes_away_ends_it_with_status_1() -> None:
    status, out, err = run("a", "b", Gone())
    assert out.count("tidalpoold 9.9") == 2
    assert (status, err) == (1, "tidalpool: the daemon at /run/tp went away: connection refused\n")


def test_no_daemon_at_all() -> None:
    assert run(Gone()) == (1, "", "tidalpool: no daemon answers at /run/tp: connection refused\n")


def test_ctrl_c_ends_it_with_status_0() -> None:
    status, out, err = run("a", KeyboardInterrupt())
    assert (status, out.count("tidalpoold 9.9"), err) == (0, 1, "")


def test_an_elastic_lease_shows_its_floor_quota_and_ceiling() -> None:
    fixed = session("s-1")
    elastic = session(
        "s-2",
        device_floor_bytes=8 * MiB,
        device_quota_bytes=48 * MiB,
        device_max_bytes=128 * MiB,
    )
    lines = draw(Sample(0.0, pool(), (fixed, elastic)), None)
    assert "64 MiB" in cells(lines, "s-1")
    assert "64 MiB of 8 MiB / 48 MiB / 128 MiB" in cells(lines, "s-2")
    assert status_view.lease_text(elastic) == "64 MiB (0 chunks) of 8 MiB / 48 MiB / 128 MiB"
