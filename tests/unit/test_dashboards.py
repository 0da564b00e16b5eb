"""The dashboards, the alert rules and docs/metrics.md against the metrics the daemon exports:
the committed dashboards are what tools/dashboards.py writes, they are well-formed Grafana
dashboards with the datasource, instance and gpu variables, and every metric they, the alerts
and the docs name is one the daemon exports (and the docs name every one)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tidalcore.units import Bytes
from tidalpoold.backends import SimBackend
from tidalpoold.metrics import DaemonCollector, Metrics
from tidalpoold.plan_worker import PlanWorker
from tidalpoold.sessions import PlanFootprint, Reason, Registry
from tidalpoold.settings import Settings

from tools import dashboards

REPO = Path(__file__).resolve().parents[2]
C = 2 * 1024 * 1024
NAME = re.compile(r"\b(?:tidalpool_[a-z0-9_]+|up)\b")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """The name of every sample a daemon with one planned session exports."""
    tmp = tmp_path_factory.mktemp("metrics")
    settings = Settings(
        device_pool=Bytes(4 * C),
        host_pool=Bytes(4 * C),
        default_device_lease=Bytes(C),
        default_host_lease=Bytes(C),
        chunk_size=Bytes(C),
        socket_dir=tmp,
        plan_cache_dir=tmp,
    )
    backend = SimBackend(4 * C, 4 * C, C)
    registry = Registry(settings, backend)
    planner = PlanWorker(settings)
    m = Metrics(gpu="0")
    counts = {"waiting": 0, "relayed": 0, "refused": 0}  # a front door's
    m.add(DaemonCollector(registry, planner, backend.facts, connections=lambda: counts))
    m.rpc.requests.labels("m", "OK").inc()
    m.rpc.seconds.labels("m", "OK").observe(0.1)
    session = registry.open(C, C, "job", 1, 0)
    session.plan = PlanFootprint(C, C)
    elastic = registry.open(0, C, "elastic", 2, 0, elastic=True, device_min=C)
    yield {s.name for family in m.registry.collect() for s in family.samples} | {"up"}
    registry.end(session.id, Reason.REASON_DETACHED, "test")
    registry.end(elastic.id, Reason.REASON_DETACHED, "test")
    planner.close()
    backend.close()


def families(samples: set[str]) -> set[str]:
    """The metric names of sample names: a histogram's `_bucket`, `_count`, `_sum` are one."""
    return {re.sub(r"_(bucket|count|sum)$", "", n) for n in samples}


def boards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted((REPO / "dashboards").glob("*.json"))}


def queries(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def test_the_committed_dashboards_are_what_the_generator_writes() -> None:
    written = dashboards.build()
    assert sorted(written) == sorted(boards()) == ["planner.json", "pool.json", "swap.json"]
    for name, board in written.items():
        assert (REPO / "dashboards" / name).read_text() == dashboards.text(board), (
            f"dashboards/{name} differs: run PYTHONPATH=client:daemon python -m tools.dashboards"
        )


@pytest.mark.parametrize("name", ["pool.json", "swap.json", "planner.json"])
def test_a_dashboard_is_importable_and_every_query_selects_its_variables(name: str) -> None:
    board = boards()[name]
    assert board["id"] is None and board["uid"] == f"tidalpool-{name.removesuffix('.json')}"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == ["datasource", "instance", "gpu"]
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource",
        "prometheus",
    )
    for var in ("instance", "gpu"):
        assert variables[var]["type"] == "query"
        assert variables[var]["multi"] and variables[var]["includeAll"]
        assert variables[var]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            for metric in set(NAME.findall(target["expr"])) - {"up"}:
                selectors = re.findall(rf"\b{metric}\{{([^}}]*)\}}", target["expr"])
                assert selectors and all(
                    s.startswith('instance=~"$instance",gpu=~"$gpu"') for s in selectors
                ), f"{panel['title']}: {metric} without the variables"


def test_dashboards_alerts_and_docs_name_only_exported_metrics(exported: set[str]) -> None:
    in_dashboards = " ".join(q for board in boards().values() for q in queries(board))
    named = {
        "dashboards": set(NAME.findall(in_dashboards)),
        "alerts": set(NAME.findall((REPO / "deploy/prometheus/tidalpool-alerts.yml").read_text())),
        "docs": set(NAME.findall((REPO / "docs/metrics.md").read_text())),
    }
    known = exported | families(exported)
    for where, names in named.items():
        names = {n for n in names if not n.endswith("_")}  # a prefix, as in tidalpool_session_.*
        assert names - known == set(), f"{where} name metrics the daemon does not export"


def test_the_docs_describe_every_exported_metric(exported: set[str]) -> None:
    docs = (REPO / "docs/metrics.md").read_text()
    documented = set(re.findall(r"^\| `(tidalpool_[a-z0-9_]+)` \|", docs, re.MULTILINE))
    assert families(exported) - {"up"} - documented == set()
