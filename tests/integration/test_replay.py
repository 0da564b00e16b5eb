"""`tidalpool replay` against real daemons: after the switch to the daemon's plan, the session
moves exactly the plan's bytes, nothing on demand, every stamp reads back right, and the step
takes about what the simulator predicted."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tidalpool.cli import main

from ..conftest import StartDaemon

MiB = 1 << 20


def training_trace(path: Path) -> Path:
    """Three iterations of a three-layer network, as a trace CSV v1.

    Weights w1..w3 of 2 MiB (persistent). Per iteration: x (1 MiB) loaded; a1..a3 (4 MiB each)
    computed forward; g (4 MiB) from a3; backward reads each activation and its weight and
    updates the weight in place; a 256 KiB buffer written last crosses into the next
    iteration. Ops take 0.5 ms (load, loss, norm), 2 ms (forward) and 3 ms (backward): the
    iteration is 16.5 ms of compute, its peak 22 MiB."""
    lines = ["kind,id,size,ns,name", *(f"alloc,{w},{2 * MiB},," for w in (1, 2, 3))]

    def op(name: str, ns: int, reads: list[int], writes: list[int]) -> None:
        lines.extend(f"read,{b},,," for b in reads)
        lines.extend(f"write,{b},,," for b in writes)
        lines.append(f"op,0,,{ns},{name}")

    for k in range(3):
        x, a1, a2, a3, g, n = (100 + 20 * k + i for i in range(6))
        lines.append(f"iter,{k},,,")
        if k:
            lines.append(f"free,{n - 20},,,")
        lines.append(f"alloc,{x},{MiB},,")
        op("load", 500_000, [], [x])
        lines.append(f"alloc,{a1},{4 * MiB},,")
        op("fwd1", 2_000_000, [x, 1], [a1])
        lines.append(f"free,{x},,,")
        lines.append(f"alloc,{a2},{4 * MiB},,")
        op("fwd2", 2_000_000, [a1, 2], [a2])
        lines.append(f"alloc,{a3},{4 * MiB},,")
        op("fwd3", 2_000_000, [a2, 3], [a3])
        lines.append(f"alloc,{g},{4 * MiB},,")
        op("loss", 500_000, [a3], [g])
        lines.append(f"free,{a3},,,")
        op("bwd3", 3_000_000, [g, a2, 3], [g, 3])
        lines.append(f"free,{a2},,,")
        op("bwd2", 3_000_000, [g, a1, 2], [g, 2])
        lines.append(f"free,{a1},,,")
        op("bwd1", 3_000_000, [g, 1], [1])
        lines.append(f"alloc,{n},{256 * 1024},,")
        op("norm", 500_000, [g], [n])
        lines.append(f"free,{g},,,")
    path.write_text("\n".join(lines) + "\n")
    return path


# Reads per iteration of blocks written before: fwd 2+2+2, loss 1, bwd 3+3+2, norm 1 = 16, each
# checked at its three stamp places (every block has at least 192 bytes).
STAMPS_PER_ITERATION = 16 * 3
OPS = 9
PER_OP_ALLOWANCE_NS = 1_000_000


@pytest.mark.parametrize(
    ("limit", "gbps"),
    [
        # Three swaps (activations), 8 MiB each way; copies at 0.5 GB/s take 8.4 ms per 4 MiB,
        # more than the gaps hide: the simulator predicts about 48 ms a step, 15 ms of it
        # waiting for copies.
        ("0.85", "0.5"),
        # Five swaps, activations and weights, 14 MiB each way at 2 GB/s: about 47 ms a step,
        # 14 ms of it waiting.
        ("0.7", "2"),
    ],
)
def test_replay_after_the_switch_moves_the_plans_bytes_and_keeps_its_time(
    limit: str,
    gbps: str,
    start_daemon: StartDaemon,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The fidelity check, with copies throttled and ops twice their traced length.

    Exact: in every steady iteration the bytes swapped out and in by the plan equal the
    prediction's, nothing moves on demand, every swap-in lands at its planned offset, every
    stamp reads back right and every access is on the device.

    Timed: the median steady step lies within 25% of the predicted step, plus 1 ms per op above
    it. The 25% covers what the simulator leaves out: the training thread issues work ahead of
    the compute stream, so copies start when the engine can issue them rather than at the
    simulated tick (measured on the development machine: 5% over the prediction at 0.5 GB/s,
    8% under it at 1 GB/s). The 1 ms per op covers how the replay keeps time: each op is a sleep
    to a deadline, which ends late by the timer slack and the scheduling delay of a busy
    two-core machine, never early, and then checks its stamps (with no swaps at all, the step
    measures 0.2 ms per op over the prediction there)."""
    daemon = start_daemon()
    trace = training_trace(tmp_path / "net.trace.csv")
    argv = ["replay", str(trace), "--limit", limit, "--copy-gbps", gbps, "--compute-scale", "2"]
    argv += ["--iterations", "8", "--socket-dir", str(daemon.socket_dir), "--json"]
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    got = json.loads(captured.out)
    assert got["outcome"] == "compared"
    assert got["limit_bytes"] == int(float(limit) * 22 * MiB)
    phases = [r["phase"] for r in got["per_iteration"]]
    switch = phases.index("switch")  # after the learning ones; the plan may take a few
    assert switch >= 3 and phases == ["learning"] * switch + ["switch"] + ["steady"] * (
        len(phases) - switch - 1
    )
    assert 8 <= len(phases) <= 11 and switch < len(phases) - 1
    predicted = got["predicted"]
    assert predicted is not None and predicted["out_bytes"] > 0
    assert predicted["copy_gbps"] == float(gbps)
    steady = [r for r in got["per_iteration"] if r["phase"] == "steady"]
    for r in steady:
        assert r["planned_out_bytes"] == predicted["out_bytes"], r
        assert r["planned_in_bytes"] == predicted["in_bytes"], r
        assert r["on_demand_out_bytes"] == r["on_demand_in_bytes"] == 0, r
        assert r["piece_misses"] == 0, r
        assert r["mismatches"] == r["not_resident"] == 0, r
        assert r["stamps_checked"] == STAMPS_PER_ITERATION, r
    checks = got["checks"]
    assert checks["mismatches"] == checks["not_resident"] == 0
    assert checks["unresolved_accesses"] == checks["missing_accesses"] == 0
    assert got["peak_resident_bytes"] <= got["limit_bytes"]
    step = statistics.median(r["step_ns"] for r in steady)
    want = predicted["step_ns"]
    assert 0.75 * want <= step <= 1.25 * want + OPS * PER_OP_ALLOWANCE_NS, (step, want)


@pytest.mark.parametrize("limit", ["0.7", "0.5"])
def test_a_paged_replay_runs_the_plan_in_pages_and_keeps_its_time(
    limit: str,
    start_daemon: StartDaemon,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Virtual residency (`--page`): the daemon's version-3 plan runs from the switch on, its
    mapped pages never above the limit, the bytes it moves exactly the prediction's, nothing
    on demand, every stamp right, and the step as the contiguous replay's is held to (above).
    At 0.5 of the peak every block but the weights' packed neighbours is swapped at some point
    (five swaps, 14 MiB each way), which a contiguous lease places only by refitting below the
    limit."""
    daemon = start_daemon()
    trace = training_trace(tmp_path / "net.trace.csv")
    argv = ["replay", str(trace), "--limit", limit, "--copy-gbps", "2", "--compute-scale", "2"]
    argv += ["--iterations", "8", "--page", "64KiB", "--socket-dir", str(daemon.socket_dir)]
    status = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    got = json.loads(captured.out)
    assert got["outcome"] == "compared" and got["page_bytes"] == 64 * 1024
    plan = got["plan"]
    assert plan["version"] == 3 and plan["page_bytes"] == 64 * 1024
    assert plan["swaps"] > 0 and plan["mapped_peak_bytes"] <= got["limit_bytes"]
    assert got["peak_resident_bytes"] <= got["limit_bytes"]
    predicted = got["predicted"]
    steady = [r for r in got["per_iteration"] if r["phase"] == "steady"]
    assert steady
    for r in steady:
        assert r["planned_out_bytes"] == predicted["out_bytes"] > 0, r
        assert r["planned_in_bytes"] == predicted["in_bytes"], r
        assert r["on_demand_out_bytes"] == r["on_demand_in_bytes"] == 0, r
        assert r["mismatches"] == r["not_resident"] == 0, r
        assert r["stamps_checked"] == STAMPS_PER_ITERATION, r
    assert got["checks"]["mismatches"] == got["checks"]["not_resident"] == 0
    step = statistics.median(r["step_ns"] for r in steady)
    want = predicted["step_ns"]
    assert 0.75 * want <= step <= 1.25 * want + OPS * PER_OP_ALLOWANCE_NS, (step, want)


def test_json_report_of_the_command_with_a_private_daemon(tmp_path: Path) -> None:
    """The console command as a user runs it, starting its own daemon: every field of the JSON
    report, progress on stderr."""
    trace = training_trace(tmp_path / "net.trace.csv")
    options = ["--limit", "0.9", "--copy-gbps", "4", "--iterations", "5", "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "tidalpool", "replay", str(trace), *options],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TIDALPOOL_SOCKET_DIR"},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert list(got) == [
        "trace",
        "backend",
        "daemon",
        "limit_bytes",
        "unconstrained_peak_bytes",
        "op_bound_bytes",
        "compute_scale",
        "copy_gbps",
        "page_bytes",
        "outcome",
        "plan_unavailable",
        "iterations",
        "learning_iterations",
        "steady_iterations",
        "fell_back_iterations",
        "plan",
        "measured",
        "predicted",
        "step_ratio",
        "peak_resident_bytes",
        "checks",
        "timeline",
        "per_iteration",
    ]
    assert (got["trace"], got["backend"], got["daemon"]) == (str(trace), "sim", "started")
    assert got["timeline"] is None  # no --timeline
    assert got["unconstrained_peak_bytes"] == 22 * MiB
    assert got["op_bound_bytes"] == 10 * MiB  # bwd3: g, a2 and w3
    assert got["limit_bytes"] == int(0.9 * 22 * MiB)
    assert (got["compute_scale"], got["copy_gbps"], got["outcome"]) == (1.0, 4.0, "compared")
    assert got["page_bytes"] == 0  # no --page: a contiguous lease
    assert got["plan_unavailable"] is None
    # Five iterations: three learning, the switch and a steady one; or, where the session takes
    # the plan an iteration or two later, up to three more to get a steady one.
    rows = got["per_iteration"]
    learning = got["learning_iterations"]
    assert 3 <= learning <= 6 and got["iterations"] == len(rows) == max(5, learning + 2)
    assert (got["steady_iterations"], got["fell_back_iterations"]) == (len(rows) - learning - 1, 0)
    assert set(got["plan"]) == {"id", "version", "limit_bytes", "swaps"}
    assert got["plan"]["version"] >= 2 and got["plan"]["limit_bytes"] <= got["limit_bytes"]
    assert set(got["predicted"]) == {
        "step_ns",
        "baseline_ns",
        "out_bytes",
        "in_bytes",
        "stall_ns",
        "peak_bytes",
        "footprint_bytes",
        "copy_gbps",
    }
    assert got["predicted"]["baseline_ns"] == 16_500_000  # the trace's ops, scale 1
    measured = got["measured"]
    assert set(measured) == {
        "step_ns",
        "host_cpu_ns",
        "planned_out_bytes",
        "planned_in_bytes",
        "on_demand_out_bytes",
        "on_demand_in_bytes",
        "stall_ns",
        "piece_misses",
        "footprint_bytes",
        "mismatches",
        "not_resident",
        "out_bytes",
        "in_bytes",
    }
    assert measured["out_bytes"] == measured["planned_out_bytes"] + measured["on_demand_out_bytes"]
    assert got["step_ratio"] == pytest.approx(measured["step_ns"] / got["predicted"]["step_ns"])
    assert set(got["checks"]) == {
        "mismatches",
        "stamps_checked",
        "not_resident",
        "unresolved_accesses",
        "missing_accesses",
    }
    assert got["checks"]["stamps_checked"] == len(rows) * STAMPS_PER_ITERATION
    assert [r["index"] for r in rows] == list(range(len(rows)))
    steady = len(rows) - learning - 1
    assert [r["phase"] for r in rows] == ["learning"] * learning + ["switch"] + ["steady"] * steady
    assert [r["mode"] for r in rows] == ["learning"] * learning + ["planned"] * (steady + 1)
    assert set(rows[0]) == {
        "index",
        "phase",
        "mode",
        "step_ns",
        "planned_out_bytes",
        "planned_in_bytes",
        "on_demand_out_bytes",
        "on_demand_in_bytes",
        "stall_ns",
        "piece_misses",
        "footprint_bytes",
        "mismatches",
        "stamps_checked",
        "not_resident",
        "host_cpu_ns",
    }
    # The training thread's CPU time is part of its wall time.
    assert all(0 < r["host_cpu_ns"] <= r["step_ns"] for r in rows)
    assert "starting a sim daemon" in out.stderr
    assert f"iteration {len(rows) - 1} (steady)" in out.stderr


def test_no_plan_is_reported_with_what_ran(
    start_daemon: StartDaemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    daemon = start_daemon("--plan-after-iterations", "0")  # this daemon never plans
    trace = training_trace(tmp_path / "net.trace.csv")
    argv = ["replay", str(trace), "--limit", "0.8", "--plan-timeout", "0.5", "--json"]
    assert main([*argv, "--socket-dir", str(daemon.socket_dir)]) == 2
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    outcome = "no plan arrived within 0.5 s after 3 iterations"
    assert got["outcome"].startswith(outcome) and outcome in captured.err
    assert [r["phase"] for r in got["per_iteration"]] == ["learning"] * 3
    assert got["plan"] is got["measured"] is got["predicted"] is None
    assert got["checks"]["mismatches"] == 0
    assert got["checks"]["stamps_checked"] == 3 * STAMPS_PER_ITERATION


def test_a_plan_the_daemon_cannot_make_ends_the_wait_with_its_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 12 MiB is over the op-wise bound (10 MiB: bwd3's g, a2 and w3), but no schedule for it
    # leaves a placement under it: the daemon says so, and the run ends without waiting. The
    # copies' bandwidth is given, so the schedules tried do not depend on the machine's.
    trace = training_trace(tmp_path / "net.trace.csv")
    limit = ["--limit", "12MiB", "--copy-gbps", "4", "--plan-timeout", "60"]
    argv = ["replay", str(trace), *limit, "--json"]
    started = time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - started < 30  # not the 60 s of --plan-timeout
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    reason = "no schedule found for limit 12 MiB (the one made for it needs 16 MiB once placed)"
    assert got["plan_unavailable"] == {
        "limit_bytes": 12 * MiB,
        "kind": "no_schedule",
        "reason": reason,
        "lowest_limit_bytes": 0,
        "shape": "",
    }
    assert got["outcome"] == f"the daemon cannot plan this session: {reason}"
    assert captured.err.splitlines()[-1] == f"tidalpool replay: {got['outcome']}"
    assert [r["phase"] for r in got["per_iteration"]] == ["learning"] * 3
    assert got["plan"] is got["measured"] is None


def test_the_timeline_shows_the_run_beside_the_simulated_step(
    start_daemon: StartDaemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--timeline`: every op, copy and wait of the run on its track, and the simulator's step
    for the plan that ran at each steady iteration's start, with the same ops."""
    daemon = start_daemon()
    trace = training_trace(tmp_path / "net.trace.csv")
    path = tmp_path / "run.json"
    argv = ["replay", str(trace), "--limit", "0.7", "--copy-gbps", "2", "--compute-scale", "2"]
    argv += ["--iterations", "6", "--page", "64KiB", "--socket-dir", str(daemon.socket_dir)]
    status = main([*argv, "--timeline", str(path), "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    got = json.loads(captured.out)
    about = got["timeline"]
    assert about["path"] == str(path) and "simulated at each steady" in about["note"]
    compute_ns = 2 * (3 * 500_000 + 3 * 2_000_000 + 3 * 3_000_000)  # the ops at ×2
    assert about["simulated_compute_busy_ns"] == compute_ns
    assert about["compute_busy_ns"] >= compute_ns * 0.99  # each op ran at least its time
    assert about["host_wait_ns"] >= 0 and about["simulated_compute_idle_ns"] >= 0

    events = json.loads(path.read_text())["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert process == {1: "measured (sim)", 2: "simulated (the daemon's plan)"}
    track = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans: dict[tuple[int, str], list[dict[str, object]]] = {}
    for e in events:
        if e["ph"] == "X":
            spans.setdefault((e["pid"], track[(e["pid"], e["tid"])]), []).append(e)
    iterations = got["iterations"]
    steady = got["steady_iterations"]
    assert steady >= 1
    # Measured: the persistent blocks' three writes, then nine ops an iteration.
    assert len(spans[(1, "compute")]) == 3 + OPS * iterations
    host = [str(e["name"]) for e in spans[(1, "host")]]
    assert sum(name.startswith("iteration ") for name in host) == iterations
    assert all(n.startswith(("iteration ", "wait: ")) for n in host)
    moved = sum(r["planned_out_bytes"] + r["on_demand_out_bytes"] for r in got["per_iteration"])
    assert sum(int(e["args"]["bytes"]) for e in spans[(1, "swap-out")]) == moved  # type: ignore[index,call-overload]
    # Simulated: the plan's step at each steady iteration, its ops and its copies.
    assert len(spans[(2, "compute")]) == OPS * steady
    assert len(spans[(2, "swap-out")]) == got["plan"]["swaps"] * steady


def test_a_trace_of_two_shapes_replays_both_in_one_session(
    shapes_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --shape: each shape --iterations times in a seeded random order, one session, one
    limit; each gets its own plan and is compared with its own prediction."""
    argv = ["replay", str(shapes_trace), "--limit", "0.8", "--page", "64KiB", "--iterations", "6"]
    assert main([*argv, "--seed", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert sorted(got["order"]) == ["128x256"] * 6 + ["512x256"] * 6
    assert got["order"] != sorted(got["order"])  # interleaved
    shapes = {s["shape"]: s for s in got["shapes"]}
    assert list(shapes) == ["512x256", "128x256"]
    plans = set()
    for s in shapes.values():
        assert s["outcome"] == "compared" and s["limit_bytes"] == got["limit_bytes"]
        assert s["iterations"] == 6 and s["learning_iterations"] == 3
        assert s["steady_iterations"] == 2 and s["checks"]["mismatches"] == 0
        assert s["checks"]["stamps_checked"] > 0 and s["checks"]["not_resident"] == 0
        assert s["measured"]["on_demand_out_bytes"] == s["measured"]["on_demand_in_bytes"] == 0
        assert s["predicted"] is not None and s["plan"]["version"] == 3
        plans.add(s["plan"]["id"])
    assert len(plans) == 2  # a plan of each shape
    largest = max(s["unconstrained_peak_bytes"] for s in shapes.values())
    assert got["limit_bytes"] == int(0.8 * largest)
    assert main([*argv, "--timeline", "t.json"]) == 2
    assert "pick one with --shape" in capsys.readouterr().err


def test_a_trace_of_two_shapes_replays_with_each_shape_recognised(
    shapes_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--recognise-shapes: the steps name no shape; every iteration is told its own shape
    (`auto-<bytes>`, checked by the replay), each gets its plan, and runs it as when named."""
    argv = ["replay", str(shapes_trace), "--limit", "0.8", "--iterations", "6"]
    assert main([*argv, "--recognise-shapes"]) == 2
    assert "give --page too" in capsys.readouterr().err
    assert main([*argv, "--recognise-shapes", "--page", "64KiB", "--shape", "128x256"]) == 2
    assert "is replayed for shape '128x256' alone" in capsys.readouterr().err
    argv += ["--page", "64KiB", "--recognise-shapes", "--seed", "3", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert sorted(got["order"]) == ["128x256"] * 6 + ["512x256"] * 6
    plans = set()
    for s in got["shapes"]:
        assert s["outcome"] == "compared" and s["steady_iterations"] == 2
        assert s["checks"]["mismatches"] == 0 and s["checks"]["not_resident"] == 0
        assert s["measured"]["on_demand_out_bytes"] == s["measured"]["on_demand_in_bytes"] == 0
        plans.add(s["plan"]["id"])
    assert len(plans) == 2
