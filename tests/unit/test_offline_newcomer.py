"""The offline tools as a new user meets them: output paths refused before any work, sizes and
counts said as they are meant, infeasible rows without an aborted simulation's numbers,
totals beyond 64 bits refused, a loose replay limit that runs, and messages that name the
command and the formats it reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest
from tidaloffline import plan_command
from tidaloffline.simulate_command import InputError, parse_limit
from tidalpool.cli import main

from .test_plan_cli import ITERATION, PROBLEM_CSV

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "traces"
# test_plan_cli's three iterations, without its header comment (line numbers count from 1).
TRACE_CSV = "kind,id,size,ns,name\nalloc,1,4096,,\n" + "".join(
    f"iter,{k},,,\n" + ITERATION.format(a=10 * k + 2, b=10 * k + 3, c=10 * k + 4) for k in range(3)
)


def _no_solve(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("the solver ran before the output paths were checked")


# -- output paths first ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "target", "message"),
    [
        ("--out", "missing/x.csv", "--out {tmp}/missing/x.csv: no such directory {tmp}/missing"),
        ("--out", "", "--out {tmp}: a directory, not a file"),
        ("--plot", "", "--plot {tmp}: a directory, not a file"),
        ("--plot", "missing/p.png", "--plot {tmp}/missing/p.png: no such directory {tmp}/missing"),
    ],
)
def test_plan_refuses_an_output_path_before_it_solves(
    option: str,
    target: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(plan_command, "solve", _no_solve)
    problem = tmp_path / "six.csv"
    problem.write_text(PROBLEM_CSV)
    path = str(tmp_path / target) if target else str(tmp_path)
    assert main(["plan", str(problem), option, path]) == 2
    assert capsys.readouterr().err == f"tidalpool plan: {message.format(tmp=tmp_path)}\n"


# -- --alignment, --json, plurals, --limit in exponent notation ------------------------------------


@pytest.mark.parametrize("alignment", ["3", "0", "384"])
def test_plan_refuses_an_alignment_that_is_not_a_power_of_two(
    alignment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    problem = tmp_path / "six.csv"
    problem.write_text(PROBLEM_CSV)
    assert main(["plan", str(problem), "--alignment", alignment]) == 2
    assert capsys.readouterr().err == (
        f"tidalpool plan: --alignment must be a power of two (1, 2, 4, ...), got {alignment}\n"
    )


def test_plan_json_is_one_object_with_what_the_report_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    problem = tmp_path / "six.csv"
    problem.write_text(PROBLEM_CSV)
    out = tmp_path / "six.solution.csv"
    assert main(["plan", str(problem), "--json", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1
    report = json.loads(printed)
    assert isinstance(report.pop("seconds"), float)
    assert report == {
        "input": str(problem),
        "format": "placement CSV",
        "iteration": None,
        "steady": None,
        "buffers": 6,
        "alignment": 1,
        "lower_bound_bytes": 7,
        "persistent_blocks": None,
        "persistent_bytes": None,
        "peak_bytes": None,  # a placement CSV has no timeline to simulate
        "smartpool_bytes": report["smartpool_bytes"],
        "smartpool_ratio": report["smartpool_bytes"] / 7,
        "height_bytes": 7,
        "ratio": 1.0,
        "solver": report["solver"],
        "optimal": True,
        "solution": str(out),
        "picture": None,
    }
    assert report["smartpool_bytes"] >= 7
    assert out.read_text().splitlines()[0] == "id,lower,upper,size,offset"


def test_plan_json_of_a_trace_names_its_iteration_and_persistent_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "three.trace.csv"
    trace.write_text(TRACE_CSV)
    assert main(["plan", str(trace), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {k: report[k] for k in report if k not in ("seconds", "solver")} == {
        "input": str(trace),
        "format": "trace CSV",
        "iteration": 1,
        "steady": "iteration 1 of 3 (iteration 2 repeats it)",
        "buffers": 3,
        "alignment": 256,
        "lower_bound_bytes": 2560,  # 512 + 2048 after the first free
        "persistent_blocks": 1,
        "persistent_bytes": 4096,
        "peak_bytes": 2560 + 4096,  # simulate's: the blocks at their most, and the persistent
        "smartpool_bytes": 2560,
        "smartpool_ratio": 1.0,
        "height_bytes": 2560,
        "ratio": 1.0,
        "optimal": True,
        "solution": None,
        "picture": None,
    }


def test_plan_counts_one_buffer_in_the_singular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    problem = tmp_path / "one.csv"
    problem.write_text("id,lower,upper,size\n0,0,2,4\n")
    trace = tmp_path / "three.trace.csv"
    trace.write_text(TRACE_CSV)
    assert main(["plan", str(problem)]) == 0
    assert main(["plan", str(trace)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"input: {problem} (placement CSV, 1 buffer, alignment 1)" in lines
    assert f"input: {trace} (trace CSV, iteration 1: 3 buffers, alignment 256)" in lines
    assert "persistent: 4096 B (4 KiB): 1 block kept across iterations, outside the arena" in lines


def test_a_csv_row_of_one_field_says_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    problem = tmp_path / "short.csv"
    problem.write_text("id,lower,upper,size\n0\n")
    assert main(["plan", str(problem)]) == 2
    assert capsys.readouterr().err == f"tidalpool plan: {problem}:2: 1 field, expected 4\n"


def test_the_replay_report_counts_one_swap_stamp_and_access_in_the_singular() -> None:
    from rich.console import Console
    from tidaloffline.replay.replayer import Record
    from tidaloffline.replay.report import Report, render

    def record(index: int, phase: str) -> Record:
        return Record(index, phase, "planned", 1_000_000, 0, 0, 0, 0, 0, 0, 4096, 0, 1, 1)

    report = Report(
        trace="t.csv",
        backend="sim",
        daemon="started",
        limit_bytes=1 << 20,
        peak_bytes=2 << 20,
        op_bound_bytes=4096,
        compute_scale=1.0,
        copy_gbps=None,
        records=[record(1, "steady")],  # one stamp checked, one access off the device
        plan={"id": 7, "version": 2, "limit_bytes": 1 << 20, "swaps": 1},
        predicted={"step_ns": 1_000_000},
    )
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    assert "plan 7 (version 2, 1 swap)" in text
    assert text.splitlines()[-1] == (
        "out on demand 0 B, in on demand 0 B, piece misses 0; 1 stamp checked, 0 wrong, 1 access"
        " off the device"
    )


@pytest.mark.parametrize(
    ("text", "limit"),
    [("1e10", 10**10), ("2.5e7", 25_000_000), ("6442450944", 6442450944), ("6GiB", 6 << 30)],
)
def test_a_limit_above_one_is_bytes_in_any_notation(text: str, limit: int) -> None:
    assert parse_limit(text, peak=1000) == limit


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1234.5", "--limit 1234.5: a number above 1 is bytes, and this one is not whole"),
        ("1e30", "--limit 1e30: 1000000000000000000000000000000 bytes is beyond a 64-bit size"),
        (
            "inf",
            "--limit inf: not a number of bytes; give a size (6GiB, 6442450944, 6.4e9 bytes) or a"
            " fraction of the unconstrained peak (0.6; a number up to 1)",
        ),
    ],
)
def test_a_limit_that_is_no_size_says_what_is_accepted(text: str, message: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_limit(text, peak=1000)
    assert str(caught.value) == message


def test_simulate_takes_a_limit_in_exponent_notation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", str(TRACES / "mlp.b64.trace.csv"), "--limit", "1e10"]
    assert main([*argv, "--policy", "daemon", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["limit_bytes"] == 10**10


# -- an infeasible row shows its reason alone ------------------------------------------------------


def test_an_infeasible_row_carries_its_reason_and_no_numbers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = str(TRACES / "resnet18.b8.trace.csv")
    argv = ["simulate", trace, "--limit", "0.7", "--policy", "checkmate"]
    assert main([*argv, "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    (row,) = report["policies"]
    assert row == {
        "name": "checkmate",
        "feasible": False,
        "schedule_feasible": False,
        "reason": "its schedule cannot run under the limit (a malloc or a swap-in never fits,"
        " or the blocks live at the start are over it)",
        "overhead": None,
        "iteration_ns": None,
        "bound_ns": report["bound_ns"],
        "ratio_to_bound": None,
        "peak_bytes": None,
        "placed_bytes": None,
        "planned_for_bytes": None,
        "out_bytes": None,
        "in_bytes": None,
        "recomputed_bytes": None,
        "recompute_ns": None,
        "stall_ns": None,
        "swaps": None,
        "recomputes": None,
    }
    monkeypatch.setenv("COLUMNS", "200")  # the table on one line, unfolded
    assert main(argv) == 3
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "checkmate" in line]
    assert [c.strip() for c in row.split("│")[1:-1]] == ["checkmate", "no: stuck", *["—"] * 8]


# -- totals beyond 64 bits are refused, naming the line --------------------------------------------

TOO_MANY = "4611686018427387904 (2**62) at most: sums of them would overflow 64 bits"


@pytest.mark.parametrize(
    ("rows", "line", "size", "total"),
    [
        (["0,0,2,9223372036854775807", "1,1,3,9223372036854775807"], 2, 2**63 - 1, 2**63 - 1),
        (["0,0,2,2305843009213693952"] * 3, 4, 2**61, 3 * 2**61),  # the third passes 2**62
    ],
)
def test_plan_refuses_a_placement_csv_whose_sizes_overflow(
    rows: list[str],
    line: int,
    size: int,
    total: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    problem = tmp_path / "big.csv"
    text = "id,lower,upper,size\n" + "".join(
        f"{k},{row.split(',', 1)[1]}\n" for k, row in enumerate(rows)
    )
    problem.write_text(text)
    assert main(["plan", str(problem)]) == 2
    assert capsys.readouterr().err == (
        f"tidalpool plan: {problem}:{line}: size {size} brings the buffers' total size to"
        f" {total} bytes, {TOO_MANY}\n"
    )


@pytest.mark.parametrize("command", ["plan", "simulate", "replay"])
def test_a_trace_whose_live_bytes_overflow_is_refused_at_its_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "big.trace.csv"
    # 4 KiB persistent, then one more persistent block that takes the total past 2**62.
    big = 2**62 - 100
    trace.write_text(TRACE_CSV.replace("alloc,1,4096,,\n", f"alloc,1,4096,,\nalloc,9,{big},,\n"))
    argv = [command, str(trace), *([] if command == "plan" else ["--limit", "0.9"])]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"tidalpool {command}: {trace}:3: alloc of block 9 brings the bytes live at once to"
        f" {big + 4096} bytes, {TOO_MANY}\n"
    )


@pytest.mark.parametrize("alignment", [str(2**31), str(2**62)])
def test_plan_refuses_an_alignment_whose_rounding_could_overflow(
    alignment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    problem = tmp_path / "six.csv"
    problem.write_text(PROBLEM_CSV)
    assert main(["plan", str(problem), "--alignment", alignment]) == 2
    assert capsys.readouterr().err == (
        f"tidalpool plan: --alignment {alignment}: at most 1073741824 (1 GiB), so that sizes"
        " rounded up to it stay within 64 bits\n"
    )


# -- bench/placement.py without its instances ------------------------------------------------------

PLACEMENT_BENCH = ROOT / "bench/placement.py"


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(PLACEMENT_BENCH), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_the_placement_bench_says_which_instances_are_missing(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    done = _bench("--traces", str(tmp_path), "--no-exact")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"bench/placement.py: instances are missing from {tmp_path} (the shared data beside this"
        " repository, or --traces DIR):",
        f"  {tmp_path}/minimalloc/challenging (no such directory): MiniMalloc's challenging"
        " instances, *.csv: the benchmarks/challenging folder of github.com/google/minimalloc",
        f"  {tmp_path}/models (no *.trace.csv in it): model traces, *.trace.csv: recorded by"
        " tidalpool.torch.record (traces/record.py --out DIR records the sample models;"
        " docs/torch.md)",
    ]


def test_the_placement_bench_measures_the_instances_it_is_given(tmp_path: Path) -> None:
    (tmp_path / "minimalloc/challenging").mkdir(parents=True)
    (tmp_path / "minimalloc/challenging/six.csv").write_text(PROBLEM_CSV)
    (tmp_path / "models").mkdir()
    (tmp_path / "models/mlp.b64.trace.csv").write_text((TRACES / "mlp.b64.trace.csv").read_text())
    done = _bench("--traces", str(tmp_path), "--no-exact", "--json", "--skip-scale")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["group"], r["instance"], r["lower_bound"]) for r in rows] == [
        ("challenging", "six", 7),
        ("model", "mlp.b64", 7922176),
    ]


# -- messages name the command and the formats it reads --------------------------------------------


@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_a_file_of_no_known_format_is_told_the_one_format_read(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "junk.csv"
    junk.write_text("hello,world\n1,2\n")
    place = tmp_path / "place.csv"
    place.write_text("id,lower,upper,size\n0,0,2,4\n")
    assert main([command, str(junk), "--limit", "0.5"]) == 2
    assert capsys.readouterr().err == (
        f"tidalpool {command}: {junk}: unknown format: expected a trace CSV v1 (header"
        " kind,id,size,ns,name)\n"
    )
    assert main([command, str(place), "--limit", "0.5"]) == 2
    assert capsys.readouterr().err == (
        f"tidalpool {command}: {place}: a placement CSV; {command} reads a trace CSV v1 (header"
        " kind,id,size,ns,name, with ops), as tidalpool.torch.record writes it\n"
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
