"""The committed dashboards are what tools/dashboards.py writes, and well-formed Grafana
dashboards with the datasource, instance and gpu variables."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tools import dashboards

REPO = Path(__file__).resolve().parents[2]
C = 2 * 1024 * 1024
NAME = re.compile(r"\b(?:tidalpool_[a-z0-9_]+|up)\b")


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
