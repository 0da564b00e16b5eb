"""A real daemon's /metrics while real sessions run: the counts the clients keep reach it, in
heartbeats while a session lives and in its Detach at the end."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from tidalclient.session import SessionStats

from tools.prometheus import metrics_address
from tools.workload import Job, Workload

from ..conftest import StartDaemon

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset({"gpu": "0", **labels}.items())))


def swap_counts(stats: SessionStats) -> tuple[int, int, int]:
    assert stats.swap is not None
    return stats.swap.swapped_out_bytes, stats.swap.swapped_in_bytes, stats.swap.stall_ns


def test_live_sessions_report_their_counts_in_heartbeats(start_daemon: StartDaemon) -> None:
    d = start_daemon(
        "--metrics-address", "127.0.0.1:0", "--log-format", "json",
        "--heartbeat-interval-s", "0.1",
    )  # fmt: skip
    address = metrics_address(d.log_path)
    jobs = [Job("planned", 8, miss=True), Job("swapper", 6, swap_fraction=0.5, copy_gbps=2.0)]
    with Workload(d.socket_dir, jobs) as work:
        work.wait_trained()
        out, into, stall_ns = swap_counts(work.stats["swapper"])
        assert out > 0 and into > 0 and stall_ns > 0
        swap = work.stats["swapper"].swap
        assert swap is not None
        on_demand = (swap.on_demand_out_bytes, swap.on_demand_in_bytes)
        assert 0 < on_demand[0] <= out and 0 < on_demand[1] <= into  # the LRU cache's, first

        def session(samples: Samples, job: str) -> dict[str, str]:
            (session_id,) = {
                dict(labels)["session_id"]
                for name, labels in samples
                if name == "tidalpool_session_peak_bytes" and ("job_name", job) in labels
            }
            return {"job_name": job, "session_id": session_id}

        deadline = time.monotonic() + 10
        while True:  # the next heartbeats carry the counts: the swapper's and the planned job's
            samples = scrape(address)
            swapper, planned = session(samples, "swapper"), session(samples, "planned")
            name = "tidalpool_session_swapped_bytes_total"
            counts = (
                value(samples, name, direction="out", **swapper),
                value(samples, name, direction="in", **swapper),
                value(samples, "tidalpool_session_swap_stall_seconds_total", **swapper),
                value(samples, "tidalpool_session_plan_misses_total", **planned),
            )
            if counts == (out, into, stall_ns / 1e9, 1):  # heartbeats sent after the last counts
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        name = "tidalpool_session_swapped_bytes_total"
        assert value(samples, name, direction="out", **swapper) == out
        assert value(samples, name, direction="in", **swapper) == into
        stall = value(samples, "tidalpool_session_swap_stall_seconds_total", **swapper)
        assert stall == stall_ns / 1e9
        assert value(samples, "tidalpool_swapped_bytes_total", direction="out") == out
        name = "tidalpool_session_swapped_on_demand_bytes_total"
        assert value(samples, name, direction="out", **swapper) == on_demand[0]
        assert value(samples, name, direction="in", **swapper) == on_demand[1]
        name = "tidalpool_swapped_on_demand_bytes_total"
        assert (value(samples, name, direction="out"), value(samples, name, direction="in")) == (
            on_demand
        )
        assert value(samples, "tidalpool_session_plan_misses_total", **planned) == 1
        assert value(samples, "tidalpool_plan_misses_total") == 1
        ratio = value(samples, "tidalpool_session_plan_fragmentation_ratio", **planned)
        assert ratio is not None and ratio >= 1
        assert value(samples, "tidalpool_sessions", state="attached") == 2


def test_a_sessions_last_counts_reach_the_daemon_with_its_detach(
    start_daemon: StartDaemon,
) -> None:
    """Heartbeats every 30 s: this short session sends none; its Detach carries its counts."""
    d = start_daemon(
        "--metrics-address", "127.0.0.1:0", "--log-format", "json",
        "--heartbeat-interval-s", "30", "--heartbeat-timeout-s", "60",
    )  # fmt: skip
    address = metrics_address(d.log_path)
    with Workload(d.socket_dir, [Job("short", 4, swap_fraction=0.5)]) as work:
        work.wait_trained()
        during = scrape(address)
    out, into, stall_ns = swap_counts(work.stats["short"])
    assert out > 0 and into > 0
    assert value(during, "tidalpool_swapped_bytes_total", direction="out") == 0  # no beat yet
    after = scrape(address)
    assert value(after, "tidalpool_swapped_bytes_total", direction="out") == out
    assert value(after, "tidalpool_swapped_bytes_total", direction="in") == into
    assert value(after, "tidalpool_swap_stall_seconds_total") == stall_ns / 1e9
    assert value(after, "tidalpool_sessions_ended_total", reason="detached") == 1
    assert not any(name.startswith("tidalpool_session_") for name, _ in after)
