"""`tidalpool simulate`: the JSON report, the sweep, the picture and clear refusals of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tidalpool.cli import main

from ..conftest import shared_file


def _resnet() -> str:
    return str(shared_file("traces/models/resnet50.b32.trace.csv"))


def test_json_report_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", _resnet(), "--limit", "0.9", "--bandwidth", "50", "--json"]
    assert main([*argv, "--policy", "vdnn-conv,autoswap-aoa,capuchin,tidalpool"]) == 0
    got = json.loads(capsys.readouterr().out)
    peak, limit = got["unconstrained_peak_bytes"], got["limit_bytes"]
    assert limit == int(0.9 * peak)
    assert got["op_bound_bytes"] < got["load_min_bytes"] < peak
    assert got["baseline_ns"] <= got["bound_ns"]
    rows = {p["name"]: p for p in got["policies"]}
    assert list(rows) == ["vdnn-conv", "autoswap-aoa", "capuchin", "tidalpool", "portfolio"]
    for p in rows.values():
        # Feasible means placed within the limit, the schedule made for a limit at or below it.
        assert p["feasible"] and p["placed_bytes"] <= limit
        assert p["peak_bytes"] <= p["planned_for_bytes"] <= limit
        assert p["bound_ns"] == got["bound_ns"] <= p["iteration_ns"]
        assert p["ratio_to_bound"] == pytest.approx(p["iteration_ns"] / got["bound_ns"])
        assert p["out_bytes"] == p["in_bytes"]
        assert (p["recomputed_bytes"] > 0) == (p["recomputes"] > 0) == (p["recompute_ns"] > 0)
    assert rows["vdnn-conv"]["recomputes"] == 0 and rows["capuchin"]["recomputes"] > 0
    best = min((p for n, p in rows.items() if n != "portfolio"), key=lambda p: p["iteration_ns"])
    assert rows["portfolio"]["of"] == best["name"]
    assert rows["portfolio"]["iteration_ns"] == best["iteration_ns"]
    # Bytes are accepted as well as fractions.
    assert (
        main(["simulate", _resnet(), "--limit", "2GiB", "--policy", "autoswap-doa", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["limit_bytes"] == 2 << 30


def test_a_plan_placed_over_the_limit_is_made_again_for_a_lower_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trace = str(shared_file("traces/models/mobilenet_v3_large.b64.trace.csv"))
    argv = ["simulate", trace, "--limit", "0.8", "--bandwidth", "50", "--policy", "autoswap-aoa"]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    (row,) = got["policies"]  # one policy: no portfolio
    limit = got["limit_bytes"]
    assert row["feasible"] and row["placed_bytes"] <= limit
    # Placed, the schedule made for the limit itself needed more: this one was made for less.
    assert row["peak_bytes"] <= row["planned_for_bytes"] < limit
    assert main(argv) == 0
    assert "yes, for" in capsys.readouterr().out


def test_sweep_walks_down_to_the_op_wise_bound(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", _resnet(), "--sweep", "--step", "0.3", "--json"]
    assert main([*argv, "--policy", "vdnn-all,autoswap-doa"]) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    fractions = [round(s["fraction"], 2) for s in got["sweep"]]
    assert fractions == [1.0, 0.7, 0.4]  # 0.1 is below the op-wise bound (10%)
    for s in got["sweep"]:  # and the best of them, where one fits
        names = [p["name"] for p in s["policies"]]
        assert names[:2] == ["vdnn-all", "autoswap-doa"] and names[2:] in ([], ["portfolio"])
    at_peak = {p["name"]: p for p in got["sweep"][0]["policies"]}
    assert at_peak["autoswap-doa"]["overhead"] == 0  # swaps only what the limit needs
    assert at_peak["vdnn-all"]["overhead"] > 0  # offloads every layer input regardless
    assert "(3/3)" in captured.err  # progress


def test_table_and_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "swaps.png"
    argv = ["simulate", _resnet(), "--limit", "0.8", "--sweep", "--step", "0.4"]
    assert main([*argv, "--policy", "vdnn-conv,autoswap-aoa", "--plot", str(picture)]) == 0
    out = capsys.readouterr().out
    assert "autoswap-aoa" in out and "load_min" in out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", _resnet(), "--limit", "0.8", "--policy", "autoswap-aoa"]) == 0
    out = capsys.readouterr().out
    assert "placed" in out and "× bound" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "0"], "--limit 0: a fraction must be above 0"),
        (["--limit", "lots"], "--limit lots"),
        (["--policy", "lru"], "unknown policy 'lru'"),
        (["--bandwidth", "0"], "must be positive"),
        (["--step", "1.5", "--sweep"], "--step must lie in (0, 1)"),
        (["--place-time", "-1"], "--place-time must be a number of seconds >= 0"),
    ],
)
def test_bad_options_are_named(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", _resnet(), *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_inputs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(tmp_path / "nope.csv")]) == 2
    assert "nope.csv: no such file" in capsys.readouterr().err
    problem = tmp_path / "problem.csv"
    problem.write_text("id,lower,upper,size\n1,0,2,4\n")
    assert main(["simulate", str(problem)]) == 2
    assert capsys.readouterr().err == (
        f"tidalpool simulate: {problem}: a placement CSV; simulate reads a trace CSV v1 (header"
        " kind,id,size,ns,name, with ops), as tidalpool.torch.record writes it\n"
    )


def test_the_daemon_row_is_the_plan_the_daemon_sends(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tidalcore.units import Bytes
    from tidaloffline.simulate_command import load
    from tidalplan import placed, placement
    from tidalplan.model import Placement, Problem
    from tidalpoold.planning import Planned, Planner
    from tidalpoold.settings import Settings

    def first_greedy(problem: Problem, time_limit_s: float = 0.0) -> Placement:
        """The placement with no time for search: the same on a loaded machine as on an idle
        one, so that both plans below are placed alike."""
        return placement.solve(problem, time_limit_s=0.0)

    monkeypatch.setattr(placed, "solve", first_greedy)

    trace = Path(__file__).resolve().parents[2] / "traces" / "resnet18.b8.trace.csv"
    argv = ["simulate", str(trace), "--limit", "0.7", "--bandwidth", "12", "--json"]
    assert main([*argv, "--policy", "daemon", "--place-time", "1"]) == 0
    got = json.loads(capsys.readouterr().out)
    (row,) = got["policies"]
    assert row["name"] == "daemon" and row["feasible"] and row["recomputes"] == 0
    settings = Settings(
        device_pool=Bytes(1 << 30),
        host_pool=Bytes(2 << 30),
        socket_dir=tmp_path,
        plan_cache_dir=tmp_path / "plans",
        metrics_address="",
        plan_time_limit_s=1.0,
    )
    made = Planner(settings).make(load(trace), got["limit_bytes"], 12.0)
    assert isinstance(made, Planned)
    assert made.update.prediction.step_ns == row["iteration_ns"]
    assert len(made.update.swap_blocks) == row["swaps"]
    assert made.update.prediction.footprint_bytes == row["placed_bytes"]


def test_with_page_the_daemon_row_is_the_paged_plan(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # resnet18.b8 at half its peak: a contiguous lease gets no plan (its placement needs more
    # than the limit); in pages of 64 KiB the daemon's plan fits, as a paged session runs it.
    trace = Path(__file__).resolve().parents[2] / "traces" / "resnet18.b8.trace.csv"
    argv = ["simulate", str(trace), "--limit", "0.5", "--policy", "daemon", "--json"]
    assert main(argv) == 3
    contiguous = json.loads(capsys.readouterr().out)
    assert contiguous["page_bytes"] is None and not contiguous["policies"][0]["feasible"]
    timeline = tmp_path / "paged.json"
    assert main([*argv, "--page", "64KiB", "--timeline", str(timeline)]) == 0
    got = json.loads(capsys.readouterr().out)
    (row,) = got["policies"]
    assert got["page_bytes"] == 64 * 1024
    assert row["feasible"] and row["swaps"] > 0
    assert row["placed_bytes"] <= got["limit_bytes"]  # the mapped pages at their peak
    assert row["planned_for_bytes"] == got["limit_bytes"]  # made once, for the limit itself
    events = json.loads(timeline.read_text())["traceEvents"]
    outs = [e for e in events if e["ph"] == "X" and e.get("cat") == "swap-out"]
    assert len(outs) == row["swaps"]  # the paged plan's step, one copy out a swap
    # in whole pages: what the paged iteration moves
    assert all(e["args"]["bytes"] % (64 * 1024) == 0 for e in outs)
    assert main([*argv, "--page", "3000"]) == 2
    assert "--page 3000 bytes: a power of two" in capsys.readouterr().err
