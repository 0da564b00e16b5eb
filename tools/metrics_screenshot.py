"""Draw the picture of docs/metrics.md from a real run: a sim daemon, training jobs that plan,
swap, stall, end and get evicted, and a Prometheus scraping it; the panels are the dashboards'
queries, read back with query_range and drawn with matplotlib.

    .venv/bin/python -m tools.metrics_screenshot [--out PNG] [--seconds N]

It writes to the temporary directory unless told otherwise (`--out docs/metrics-dashboard.png`
replaces the committed picture).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tidalclient.local import LocalDaemon

from tools.prometheus import Prometheus, ensure_prometheus, metrics_address
from tools.workload import Job, Workload

OUT = Path(tempfile.gettempdir()) / "tidalpool-metrics-dashboard.png"
"""Where the picture goes by default: not the checkout, whose docs/metrics-dashboard.png is
committed."""

PAGE = 4096
"""The swapping jobs' pages (virtual residency, as the demo's): their plans fit half the peak."""

JOBS = [
    Job("resnet", 150, miss=True, pause_s=0.15, stay=False),
    Job("bert-swap", 110, 0.5, copy_gbps=1.0, page_bytes=PAGE, pause_s=0.15, start_s=6, stay=False),
    Job("gpt-swap", 90, 0.5, copy_gbps=0.4, page_bytes=PAGE, pause_s=0.15, start_s=14, stay=False),
    Job("resnet-again", 80, pause_s=0.15, start_s=24, stay=False),
    Job("stuck", 20, pause_s=0.5, start_s=30, evict=True),
]


@dataclass(frozen=True)
class Chart:
    title: str
    queries: list[tuple[str, str]]  # (PromQL, legend: a label name, or text)
    unit: str  # "MiB", "MiB/s", "%", "" (a count)
    stacked: bool = False


CHARTS = [
    Chart(
        "Pool: device bytes by state",
        [('tidalpool_pool_bytes{pool="device"}', "state")],
        "MiB",
    ),
    Chart(
        "Pool: device bytes used, by session",
        [('tidalpool_session_used_bytes{pool="device"}', "job_name")],
        "MiB",
        stacked=True,
    ),
    Chart(
        "Swap: traffic",
        [("sum by (direction) (rate(tidalpool_swapped_bytes_total[4s]))", "direction")],
        "MiB/s",
    ),
    Chart(
        "Swap: stall fraction, by session",
        [("rate(tidalpool_session_swap_stall_seconds_total[4s])", "job_name")],
        "%",
    ),
    Chart(
        "Planner: plans and plan misses",
        [
            ("tidalpool_plans_total", "outcome"),
            ("tidalpool_plan_misses_total", "plan misses"),
        ],
        "",
    ),
    Chart(
        "Sessions",
        [
            ('tidalpool_sessions{state="attached"}', "attached"),
            ("tidalpool_sessions_ended_total", "reason"),
        ],
        "",
    ),
]

SCALE = {"MiB": 1 / 2**20, "MiB/s": 1 / 2**20, "%": 100.0, "": 1.0}


def run(seconds: float, directory: Path) -> tuple[Prometheus, float, float]:
    """Run the jobs under a scraped daemon; Prometheus (still running) and the time span."""
    daemon = LocalDaemon.start(
        directory / "daemon",
        device_pool="24MiB",
        host_pool="64MiB",
        default_lease="4MiB",
        chunk_size="2MiB",
        extra=("--metrics-address", "127.0.0.1:0", "--log-format", "json",
               "--heartbeat-interval-s", "0.25"),
    )  # fmt: skip
    try:
        prom = Prometheus.start(
            directory / "prometheus", [metrics_address(daemon.log_path)], scrape_interval_s=1.0
        )
        prom.wait_for('up{job="tidalpool"} == 1')
        start = time.time()
        with Workload(daemon.socket_dir, JOBS) as work:
            work.wait_trained(timeout_s=seconds)
            time.sleep(max(0.0, seconds - (time.time() - start)))
        time.sleep(3)
        return prom, start - 2, time.time()
    finally:
        daemon.stop()


def draw(prom: Prometheus, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use("dark_background")
    fig, axes = plt.subplots(3, 2, figsize=(14, 11), dpi=100, sharex=True)
    for ax, chart in zip(axes.flat, CHARTS, strict=True):
        xs_all, ys_all, labels, styles = [], [], [], []
        for k, (expr, legend) in enumerate(chart.queries):
            for series in prom.query_range(expr, start, end, 1.0):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                xs_all.append([t for t, _ in points])
                ys_all.append([v * SCALE[chart.unit] for _, v in points])
                labels.append(series["metric"].get(legend, legend))
                styles.append("-" if k == 0 else "--")  # the second query's series dashed
        if chart.stacked and xs_all:
            grid = sorted({t for xs in xs_all for t in xs})
            stacks = [
                [dict(zip(xs, ys, strict=True)).get(t, 0.0) for t in grid]
                for xs, ys in zip(xs_all, ys_all, strict=True)
            ]
            ax.stackplot(grid, *stacks, labels=labels, alpha=0.8)
        else:
            for xs, ys, label, style in zip(xs_all, ys_all, labels, styles, strict=True):
                ax.plot(xs, ys, style, label=label, linewidth=1.5)
        ax.set_title(chart.title, loc="left", fontsize=11)
        ax.set_ylabel(chart.unit)
        ax.grid(alpha=0.2)
        ax.legend(fontsize=8, loc="upper left", ncols=2)
    for ax in axes[-1]:
        ax.set_xlabel("seconds")
    fig.suptitle(
        "tidalpool metrics from a real run: sim daemon, five jobs, Prometheus query_range",
        fontsize=13,
    )
    fig.tight_layout()
    fig.savefig(out)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"the picture (default {OUT})")
    parser.add_argument("--seconds", type=float, default=50.0, help="length of the run")
    return parser


def main() -> None:
    args = arguments().parse_args()
    why_not = ensure_prometheus()
    if why_not is not None:
        raise SystemExit(why_not)
    with tempfile.TemporaryDirectory(prefix="tp-shot-", dir="/tmp") as tmp:
        prom, start, end = run(args.seconds, Path(tmp))
        with prom:
            draw(prom, start, end, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
