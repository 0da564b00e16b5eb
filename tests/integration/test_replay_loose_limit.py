"""`tidalpool replay` at a limit the lease cannot exceed: a looser limit never fails. The session's
swap limit is then a chunk under its lease, where the swap engine makes room for the plan's
arena at the switch (at or above the lease it made none, and every iteration ran learning)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tidaloffline.replay.command import CHUNK, lease_bytes, session_limit

MiB = 1 << 20
MLP = Path(__file__).resolve().parents[2] / "traces/mlp.b64.trace.csv"
MLP_PEAK = 22832640  # the MLP trace's unconstrained peak, 21.8 MiB
MLP_LEASE = 30 * MiB  # its peak, a quarter more and a chunk, in whole chunks


def test_a_limit_not_below_the_lease_becomes_a_chunk_under_it() -> None:
    assert lease_bytes(MLP_PEAK) == MLP_LEASE
    assert session_limit(29 * MiB, MLP_LEASE) == 29 * MiB
    assert session_limit(MLP_LEASE - 1, MLP_LEASE) == MLP_LEASE - 1
    assert session_limit(MLP_LEASE, MLP_LEASE) == MLP_LEASE - CHUNK == 28 * MiB
    assert session_limit(1 << 30, MLP_LEASE) == 28 * MiB


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
    assert got["limit_bytes"] == (30 * MiB if limit == "30MiB" else 1 << 30)
    assert got["session_limit_bytes"] == 28 * MiB
    assert got["plan"]["limit_bytes"] == 28 * MiB and got["plan"]["swaps"] == 0
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
