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
    assert main([*argv, "--policy", "vdnn-conv,autoswap-aoa,tidalpool"]) == 0
    got = json.loads(capsys.readouterr().out)
    peak = got["unconstrained_peak_bytes"]
    assert got["limit_bytes"] == int(0.9 * peak)
    assert got["op_bound_bytes"] < got["load_min_bytes"] < peak
    rows = {p["name"]: p for p in got["policies"]}
    assert list(rows) == ["vdnn-conv", "autoswap-aoa", "tidalpool"]
    for p in rows.values():
        assert p["feasible"] and p["peak_bytes"] <= got["limit_bytes"]
        assert p["out_bytes"] == p["in_bytes"] > 0
        assert p["footprint_bytes"] >= p["peak_bytes"] - 256 * p["swaps"]
    assert rows["tidalpool"]["overhead"] <= min(p["overhead"] for p in rows.values())
    # Bytes are accepted as well as fractions.
    assert (
        main(["simulate", _resnet(), "--limit", "2GiB", "--policy", "autoswap-doa", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["limit_bytes"] == 2 << 30


def test_fit_plans_for_a_lower_limit_until_the_placement_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trace = str(shared_file("traces/models/mobilenet_v3_large.b64.trace.csv"))
    argv = ["simulate", trace, "--limit", "0.8", "--bandwidth", "50", "--policy", "autoswap-aoa"]
    argv += ["--place-time", "0"]  # the first greedy placement: the same on every machine
    assert main([*argv, "--json"]) == 0
    (plain,) = json.loads(capsys.readouterr().out)["policies"]
    assert main([*argv, "--json", "--fit"]) == 0
    got = json.loads(capsys.readouterr().out)
    (fitted,) = got["policies"]
    limit = got["limit_bytes"]
    assert plain["footprint_bytes"] > limit  # placed, the schedule for the limit needs more
    assert plain["planned_for_bytes"] is None and plain["fits"] is None
    assert fitted["fits"] and fitted["footprint_bytes"] <= limit
    assert (
        fitted["planned_for_bytes"] < limit and fitted["peak_bytes"] <= fitted["planned_for_bytes"]
    )
    assert fitted["overhead"] >= plain["overhead"]
    assert main([*argv, "--fit"]) == 0
    assert "planned for" in capsys.readouterr().out
    assert main([*argv, "--fit", "--no-footprint"]) == 2
    assert "cannot go with --no-footprint" in capsys.readouterr().err
    assert main([*argv, "--fit", "--sweep"]) == 2
    assert "--fit works at one --limit" in capsys.readouterr().err


def test_sweep_walks_down_to_the_op_wise_bound(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", _resnet(), "--sweep", "--step", "0.3", "--json"]
    assert main([*argv, "--policy", "vdnn-all,autoswap-doa"]) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    fractions = [round(s["fraction"], 2) for s in got["sweep"]]
    assert fractions == [1.0, 0.7, 0.4]  # 0.1 is below the op-wise bound (10%)
    assert all(len(s["policies"]) == 2 for s in got["sweep"])
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
    assert "footprint" in capsys.readouterr().out


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
    assert "simulate needs a trace CSV v1" in capsys.readouterr().err
