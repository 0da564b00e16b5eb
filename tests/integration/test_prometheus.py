"""The alert rules through promtool, and the dashboards and alerts against a real Prometheus
scraping a real daemon whose sessions plan, miss, swap, stall and get evicted.

Every query of every dashboard panel and variable runs through Prometheus's HTTP API with the
variables set to this daemon (`$__rate_interval` to 5 s, a few scrapes); each must succeed and
return at least one series. An alert's expression is a condition (`X > 0.25`): Prometheus
evaluates the rule itself (its health must be ok), and the test queries X, the expression
without its final comparison, which must return series: the alert watches something that
exists. The eviction alert, whose condition holds in this run, must fire.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tools.prometheus import Prometheus, ensure_prometheus, metrics_address
from tools.workload import Job, Workload

from ..conftest import StartDaemon

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus"
DASHBOARDS = REPO / "dashboards"

CONDITION = re.compile(r"^(?P<watched>.*\S)\s*(?:>=|<=|==|!=|>|<)\s*[0-9.]+$", re.DOTALL)
"""An alert expression: what it watches, then one comparison with a number."""


@pytest.fixture(scope="module")
def prometheus_installed() -> None:
    why_not = ensure_prometheus()
    if why_not is not None:
        pytest.skip(why_not)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], cwd=RULES, capture_output=True, text=True, timeout=60
    )


def test_the_alert_rules_and_the_example_config_pass_promtool(prometheus_installed: None) -> None:
    for args in (
        ("check", "rules", "tidalpool-alerts.yml"),
        ("check", "config", "prometheus.yml"),
        ("test", "rules", "tidalpool-alerts.test.yml"),
    ):
        out = promtool(*args)
        assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"
        assert "SUCCESS" in out.stdout + out.stderr


def panel_queries() -> list[tuple[str, str]]:
    """(where, query) of every panel target and variable of every dashboard."""
    queries = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                queries.append((f"{path.name}: {panel['title']}", target["expr"]))
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                queries.append((f"{path.name}: variable {var['name']}", var["definition"]))
    return queries


def substitute(query: str, variables: dict[str, str]) -> str:
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        query = query.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in query, f"a variable the test does not set: {query}"
    return query


def label_values(query: str) -> tuple[str, str] | None:
    """Grafana's label_values(SELECTOR, LABEL) as (SELECTOR, LABEL); None for PromQL."""
    found = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)
    return None if found is None else (found[1], found[2])


def test_every_dashboard_query_and_alert_has_series_from_a_real_daemon(
    prometheus_installed: None, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    d = start_daemon(
        "--metrics-address", "127.0.0.1:0", "--log-format", "json",
        "--heartbeat-interval-s", "0.2", "--gpu", "0",
    )  # fmt: skip
    address = metrics_address(d.log_path)
    jobs = [
        Job("mlp", iterations=8, miss=True),
        Job("mlp-swap", iterations=8, swap_fraction=0.5, copy_gbps=1.0),
        Job("evicted", iterations=2, evict=True),
        Job("mlp-elastic", iterations=8, swap_fraction=0.9, page_bytes=64 * 1024, elastic=True),
    ]
    with Prometheus.start(
        tmp_path / "prometheus", [address], [RULES / "tidalpool-alerts.yml"]
    ) as p:
        # Prometheus applies its targets a few seconds after it starts: the jobs start once it
        # has the counters' first values (an eviction before that would be no increase).
        p.wait_for('up{job="tidalpool"} == 1')
        with Workload(d.socket_dir, jobs) as work:
            work.wait_trained()
            check_series(p, address, work)


def check_series(p: Prometheus, address: str, work: Workload) -> None:
    swapper, planned = work.stats["mlp-swap"], work.stats["mlp"]
    assert swapper.swap is not None and swapper.swap.swapped_out_bytes > 0
    assert planned.mode == "planned" and planned.plan_misses == 1
    # The daemon's numbers are the clients' (heartbeats every 0.2 s, scrapes every 0.5 s).
    swap_job = '{job_name="mlp-swap"}'
    swap = swapper.swap
    for expr in (
        f'tidalpool_session_swapped_bytes_total{{job_name="mlp-swap",direction="out"}}'
        f" == {swap.swapped_out_bytes}",
        f'tidalpool_session_swapped_bytes_total{{job_name="mlp-swap",direction="in"}}'
        f" == {swap.swapped_in_bytes}",
        f"tidalpool_session_swap_stall_seconds_total{swap_job} > 0",
        'tidalpool_session_plan_misses_total{job_name="mlp"} == 1',
        'tidalpool_session_plan_fragmentation_ratio{job_name="mlp"} >= 1',
        'tidalpool_sessions_ended_total{reason="evicted"} == 1',
        'tidalpool_grpc_requests_total{method="tidalpool.v1.Pool/Attach",code="OK"} == 4',
        'tidalpool_session_device_quota_bytes{job_name="mlp-elastic",bound="floor"} > 0',
        'tidalpool_plans_total{outcome="solved"} >= 1',
        "tidalpool_trace_events_received_total > 0",
        f"count_over_time(tidalpool_session_peak_bytes{swap_job}[5s]) >= 4",  # rates have data
    ):
        p.wait_for(expr, timeout_s=15)

    variables = {"datasource": "", "instance": address, "gpu": "0", "__rate_interval": "5s"}
    empty: list[str] = []
    for where, query in panel_queries():
        query = substitute(query, variables)
        selector_label = label_values(query)
        if selector_label is not None:
            selector, label = selector_label
            series = p.query(selector)
            if not any(label in s["metric"] for s in series):
                empty.append(f"{where}: {query}")
        elif not p.query(query):
            empty.append(f"{where}: {query}")
    assert empty == [], "queries without series:\n" + "\n".join(empty)

    rules = p.rules()
    assert {r["name"] for r in rules} == {
        "TidalpoolPoolNearlyExhausted",
        "TidalpoolSwapStallHigh",
        "TidalpoolSessionsEvicted",
        "TidalpoolDaemonDown",
    }
    for rule in rules:
        condition = CONDITION.match(rule["query"])
        assert condition is not None, f"{rule['name']}: not `X <op> number`: {rule['query']}"
        assert p.query(condition["watched"]), f"{rule['name']}: no series for {condition[1]}"
    p.wait_for('ALERTS{alertname="TidalpoolSessionsEvicted",alertstate="firing"}')
    firing = {a["metric"]["alertname"] for a in p.query('ALERTS{alertstate="firing"}')}
    assert firing == {"TidalpoolSessionsEvicted"}
    for rule in p.rules():
        assert (rule["health"], rule.get("lastError", "")) == ("ok", ""), rule
