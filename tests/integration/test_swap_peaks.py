"""A session under a swap limit: its device peak is what it held on the device at once, within
the limit, and the live bytes it held meanwhile on the host are reported apart, in
`tidalpool status` (table and JSON), `top` and /metrics."""

from __future__ import annotations

import io
import json
import time

import tidalpool
from rich.console import Console
from tidalclient import status, top
from tidalcore.v1 import common_pb2

from tools.prometheus import metrics_address

from ..conftest import StartDaemon
from .test_metrics import scrape, value

MiB = 1 << 20


def test_device_peak_stays_under_the_swap_limit(start_daemon: StartDaemon) -> None:
    d = start_daemon(
        "--metrics-address", "127.0.0.1:0", "--log-format", "json",
        "--heartbeat-interval-s", "0.1",
    )  # fmt: skip
    address = metrics_address(d.log_path)
    with tidalpool.attach(
        d.socket_dir, device_limit="16MiB", host_limit="16MiB", swap_limit="6MiB", job_name="sw"
    ) as s:
        tensors = [s.tensor(MiB, "uint8") for _ in range(12)]  # 12 MiB live: 6 go to the host
        for t in tensors:
            with s.op(writes=[t]) as (v,):
                v[:] = 1
        stats = s.stats()
        assert stats.swap is not None and stats.swap.peak_resident_bytes <= 6 * MiB
        assert stats.peak_live_bytes == 12 * MiB

        deadline = time.monotonic() + 30
        while True:  # until a heartbeat sent after the last op has reached the daemon
            pool, listed = status.fetch(d.socket_dir)
            (info,) = listed.sessions
            if info.live_peak_bytes == 12 * MiB or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert info.live_peak_bytes == 12 * MiB
        assert info.device_peak_bytes == stats.swap.peak_resident_bytes
        assert info.device_peak_bytes == 6 * MiB  # the limit, filled: never the 12 MiB live

        (shown,) = json.loads(status.as_json(pool, listed))["sessions"]
        assert shown["device_peak_bytes"] == info.device_peak_bytes
        assert shown["live_peak_bytes"] == 12 * MiB

        assert status.peak_text(info) == "6 MiB (12 MiB live)"
        out = io.StringIO()
        status.render(pool, listed, Console(file=out, width=300))
        assert "device peak" in out.getvalue()
        assert "6 MiB (12 MiB live)" in out.getvalue()

        samples = scrape(address)
        labels = {"session_id": s.id, "job_name": "sw"}
        assert value(samples, "tidalpool_session_peak_bytes", **labels) == info.device_peak_bytes
        assert value(samples, "tidalpool_session_live_peak_bytes", **labels) == 12 * MiB


def test_a_session_that_does_not_swap_shows_one_peak() -> None:
    info = common_pb2.SessionInfo(device_peak_bytes=3 * MiB, live_peak_bytes=3 * MiB)
    assert status.peak_text(info) == "3 MiB"
    assert top.peak_text is status.peak_text
