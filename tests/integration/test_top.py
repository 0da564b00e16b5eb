"""`tidalpool top` against a real daemon with sessions attached, as a script sees it (not a
terminal: one frame after another); and how it ends when the daemon goes or on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import tidalpool
from tidalclient.local import LocalDaemon
from tidalclient.status import fetch
from tidalcore.units import format_size

from ..conftest import StartDaemon
from .test_cli import run_cli

KiB = 1024


def row(frame: str, first: str) -> list[str]:
    """The cells of the frame's row that begins with `first` (columns: 2+ spaces apart)."""
    (line,) = (line for line in frame.splitlines() if line.startswith(first))
    return re.split(r"\s{2,}", line.strip())


def test_top_shows_the_pools_the_sessions_and_what_they_swapped(start_daemon: StartDaemon) -> None:
    daemon = start_daemon("--heartbeat-interval-s", "0.1")
    with (
        tidalpool.attach(
            daemon.socket_dir, "4MiB", "4MiB", job_name="swapper", swap_limit=16 * KiB
        ) as swapper,
        tidalpool.attach(daemon.socket_dir, "8MiB", job_name="plain") as plain,
    ):
        tensors = [swapper.tensor((1024,), "float32") for _ in range(8)]  # 4 KiB each
        for t in tensors:
            with swapper.op(writes=[t], name="fill") as (v,):
                v[:] = 1.0
        swap = swapper.stats().swap
        assert swap is not None and swap.swapped_out_bytes >= 16 * KiB
        # The daemon knows the counts once a heartbeat has carried them.
        deadline = time.monotonic() + 10
        while True:
            listed = {s.session_id: s for s in fetch(daemon.socket_dir)[1].sessions}
            info = listed[swapper.id]
            if (info.swapped_out_bytes, info.swapped_in_bytes) == (
                swap.swapped_out_bytes,
                swap.swapped_in_bytes,
            ):
                break
            assert time.monotonic() < deadline, (info, swap)
            time.sleep(0.05)
        out = run_cli(
            "--socket-dir",
            str(daemon.socket_dir),
            "top",
            "--iterations",
            "2",
            "--interval",
            "0.2",
            env={"COLUMNS": "250"},
        )
    assert (out.returncode, out.stderr) == (0, "")
    frames = out.stdout.split("tidalpoold ")[1:]
    assert len(frames) == 2, out.stdout
    first, second = frames
    assert "· backend sim (memfd) · chunks of 2 MiB ·" in first
    assert "· 2 session(s) · every 0.2 s ·" in first
    # 4 MiB and 8 MiB leased of the 256 MiB pools.
    assert row(first, "device")[:3] == ["device", "256 MiB", "12 MiB"]
    assert row(first, "host")[:3] == ["host", "256 MiB", "68 MiB"]  # 64 MiB: plain's default
    header = row(first, "session")
    cells = dict(zip(header, row(first, swapper.id), strict=True))
    assert cells["job"] == "swapper"
    assert cells["pid"] == str(os.getpid())
    assert (cells["lease"], cells["swap limit"]) == ("4 MiB", "16 KiB")
    assert cells["swapped out"] == format_size(swap.swapped_out_bytes)
    assert cells["swapped in"] == format_size(swap.swapped_in_bytes)
    assert cells["stalled"] == "–"  # no rate before the second sample
    cells = dict(zip(header, row(first, plain.id), strict=True))
    assert (cells["job"], cells["lease"], cells["swap limit"]) == ("plain", "8 MiB", "–")
    assert "swap traffic: measured from the next refresh on" in first
    # Nothing swapped between the two samples: the rates are 0.
    assert "swap traffic: 0 B/s out, 0 B/s in" in second
    cells = dict(zip(header, row(second, swapper.id), strict=True))
    assert cells["swapped out"] == f"{format_size(swap.swapped_out_bytes)} (0 B/s)"
    assert cells["stalled"] == "0 %"


def start_top(daemon: LocalDaemon) -> subprocess.Popen[str]:
    """`tidalpool top` refreshing every 0.1 s until it is stopped, once its first frame is out."""
    command = [sys.executable, "-m", "tidalpool", "--socket-dir", str(daemon.socket_dir)]
    top = subprocess.Popen(
        [*command, "top", "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert top.stdout is not None
    assert top.stdout.readline().startswith("tidalpoold ")
    return top


def test_top_ends_with_status_1_when_the_daemon_goes_away(daemon: LocalDaemon) -> None:
    top = start_top(daemon)
    try:
        assert daemon.stop() == 0
        _, err = top.communicate(timeout=30)
    finally:
        top.kill()
        top.wait()  # reaped here, not warned about in a later test
    assert top.returncode == 1
    assert err.startswith(f"tidalpool: the daemon at {daemon.socket_dir} went away: "), err


def test_top_ends_with_status_0_on_ctrl_c(daemon: LocalDaemon) -> None:
    top = start_top(daemon)
    try:
        top.send_signal(signal.SIGINT)
        _, err = top.communicate(timeout=30)
    finally:
        top.kill()
        top.wait()  # reaped here, not warned about in a later test
    assert (top.returncode, err) == (0, "")
