"""`tidalpool replay` at a limit the lease cannot exceed: a looser limit never fails. At the
switch the swap engine makes a range for the plan's arena whatever the limit (at or above the
lease it made none, and every iteration ran learning)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MiB = 1 << 20
MLP = Path(__file__).resolve().parents[2] / "traces/mlp.b64.trace.csv"


@pytest.mark.parametrize("limit", ["30MiB", "1GiB"])
def test_a_loose_limit_runs_steady_iterations_under_the_plan(limit: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tidalpool", "replay", str(MLP), "--limit", limit, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TIDALPOOL_SOCKET_DIR"},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["outcome"] == "compared"
    asked = 30 * MiB if limit == "30MiB" else 1 << 30
    assert got["limit_bytes"] == got["plan"]["limit_bytes"] == asked  # the limit asked runs
    assert got["plan"]["swaps"] == 0
    # Eight iterations: three learning, the switch, four steady (a session that takes the plan
    # later has fewer learning ones left to run at the end, never fewer than one steady).
    phases = [r["phase"] for r in got["per_iteration"]]
    assert phases[:3] == ["learning"] * 3
    assert "switch" in phases and phases.count("steady") >= 1
    assert got["fell_back_iterations"] == 0
    steady = [r for r in got["per_iteration"] if r["phase"] == "steady"]
    assert all(r["on_demand_out_bytes"] == r["on_demand_in_bytes"] == 0 for r in steady)
    assert got["checks"]["mismatches"] == 0 and got["checks"]["not_resident"] == 0
    assert got["checks"]["stamps_checked"] > 0
