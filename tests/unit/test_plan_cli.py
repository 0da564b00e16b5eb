"""`tidalpool plan`: each input format in, the report out, the solution written and re-checked."""

from __future__ import annotations

import argparse
import csv
import io
import pickle
import sys
from pathlib import Path

import pytest
from tidalcore.units import Bytes, Offset, Tick
from tidaloffline import plan_command as plan_cli
from tidalplan.model import Buffer, Placement, Problem
from tidalplan.validate import validate

# Six buffers (test_placement's SIX); live bytes per tick 5 6 5 7 6 4: the bound is 7.
PROBLEM_CSV = """id,lower,upper,size
a,0,2,4
b,1,5,2
c,2,6,3
d,4,6,1
e,0,1,1
f,3,4,2
"""

# Three iterations of: alloc 1 KiB, alloc 512 B, op, free the first, alloc 2 KiB, op, free, free.
ITERATION = """alloc,{a},1024,,
alloc,{b},512,,
op,0,,1000,aten.mm.default
free,{a},,,
alloc,{c},2048,,
op,1,,1000,aten.relu.default
free,{b},,,
free,{c},,,
"""
TRACE_CSV = "# tidalpool trace v1\nkind,id,size,ns,name\nalloc,1,4096,,\n" + "".join(
    f"iter,{k},,,\n" + ITERATION.format(a=10 * k + 2, b=10 * k + 3, c=10 * k + 4) for k in range(3)
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tidalpool")
    plan_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["plan", *argv])


def run(*argv: str) -> tuple[int, list[str], str]:
    """Exit status, stdout lines without the seconds, stderr."""
    out, err = io.StringIO(), io.StringIO()
    status = plan_cli.run(parse(*argv), out=out, err=err)
    printed = out.getvalue().splitlines()
    lines = [x for x in printed if not x.startswith("seconds: ")]
    assert len(printed) - len(lines) == (1 if printed else 0)  # one "seconds" line, if any
    return status, lines, err.getvalue()


def read_solution(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.fixture
def problem_csv(tmp_path: Path) -> Path:
    path = tmp_path / "four.csv"
    path.write_text(PROBLEM_CSV)
    return path


def test_placement_csv_in_solution_out(problem_csv: Path, tmp_path: Path) -> None:
    out = tmp_path / "solution.csv"
    status, lines, err = run(str(problem_csv), "--out", str(out), "--no-exact")
    assert (status, err) == (0, "")
    assert lines == [
        f"input: {problem_csv} (placement CSV, 6 buffers, alignment 1)",
        "lower bound: 7 B (7 B)",
        "smartpool: 8 B (ratio 1.1429)",
        "height: 7 B (ratio 1.0000, canonical/length)",
        "optimal: yes",
        f"solution: {out}",
    ]
    rows = read_solution(out)
    assert [r["id"] for r in rows] == ["a", "b", "c", "d", "e", "f"]
    assert [int(r["offset"]) for r in rows] == [0, 5, 0, 3, 4, 3]  # as test_placement shows
    problem = Problem(
        tuple(
            Buffer(i, Tick(int(r["lower"])), Tick(int(r["upper"])), Bytes(int(r["size"])))
            for i, r in enumerate(rows)
        )
    )
    offsets = tuple(Offset(int(r["offset"])) for r in rows)
    validate(problem, Placement(offsets, Bytes(7), "re-read"))


def test_trace_in(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.trace.csv"
    trace.write_text(TRACE_CSV)
    out = tmp_path / "solution.csv"
    status, lines, _ = run(str(trace), "--out", str(out))
    assert status == 0
    assert lines == [
        f"input: {trace} (trace CSV, iteration 1: 3 buffers, alignment 256)",
        "steady: iteration 1 of 3 (iteration 2 repeats it)",
        # 512 + 2048 padded, at the second op
        "lower bound: 2560 B (2.5 KiB): the arena, the iteration's blocks at their most",
        # block 1, allocated before the first iteration
        "persistent: 4096 B (4 KiB): 1 block kept across iterations, outside the arena",
        "lower bound + persistent: 6656 B (6.5 KiB): the peak tidalpool simulate reports",
        "smartpool: 2560 B (ratio 1.0000)",
        "height: 2560 B (ratio 1.0000, canonical/length)",
        "height + persistent: 6656 B (6.5 KiB): the device bytes under this placement",
        "optimal: yes",
        f"solution: {out}",
    ]
    rows = read_solution(out)
    assert sorted(r["id"] for r in rows) == ["12", "13", "14"]  # the trace's block ids
    assert {r["id"]: int(r["size"]) for r in rows} == {"12": 1024, "13": 512, "14": 2048}


def test_snapshot_in(tmp_path: Path) -> None:
    snapshot = {
        "device_traces": [
            [
                {"action": "alloc", "addr": 0, "size": 1000},
                {"action": "alloc", "addr": 4096, "size": 3000},
                {"action": "free", "addr": 0, "size": 1000},
                {"action": "alloc", "addr": 0, "size": 500},
                {"action": "free", "addr": 4096, "size": 3000},
                {"action": "free", "addr": 0, "size": 500},
            ]
        ]
    }
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    status, lines, _ = run(str(path), "--alignment", "512")
    assert status == 0
    assert lines == [
        f"input: {path} (memory snapshot, 3 buffers, alignment 512)",
        "lower bound: 4096 B (4 KiB)",  # 1024 + 3072
        "smartpool: 4096 B (ratio 1.0000)",
        "height: 4096 B (ratio 1.0000, canonical/length)",
        "optimal: yes",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.csv"], "tidalpool plan: {tmp}/missing.csv: no such file\n"),
        (["."], "tidalpool plan: {tmp}: not a file\n"),
        (["junk.csv"], "tidalpool plan: {tmp}/junk.csv: unknown format: expected a trace CSV v1"),
        (["bad.csv"], "tidalpool plan: {tmp}/bad.csv:3: size 0 is not positive\n"),
        (
            ["four.csv", "--alignment", "0"],
            "tidalpool plan: --alignment must be a power of two (1, 2, 4, ...), got 0\n",
        ),
        (
            ["four.csv", "--alignment", "3"],
            "tidalpool plan: --alignment must be a power of two (1, 2, 4, ...), got 3\n",
        ),
        (
            ["four.csv", "--time-limit", "0"],
            "tidalpool plan: --time-limit must be positive, got 0.0",
        ),
        (
            ["four.csv", "--out", "no/such/dir/s.csv"],
            "tidalpool plan: --out no/such/dir/s.csv: no such directory no/such/dir\n",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_problem(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "four.csv").write_text(PROBLEM_CSV)
    (tmp_path / "junk.csv").write_text("hello,world\n1,2\n")
    (tmp_path / "bad.csv").write_text("id,lower,upper,size\n0,0,1,4\n1,0,1,0\n")
    paths = [str(tmp_path / a) if a in ("missing.csv", ".", "junk.csv", "bad.csv") else a
             for a in argv]  # fmt: skip
    status, _, err = run(*paths)
    assert status == 2
    expected = message.format(tmp=tmp_path)
    assert err.startswith(expected) if not expected.endswith("\n") else err.endswith(expected)


def test_invalid_placement_is_never_printed(
    problem_csv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(problem: Problem, **kwargs: object) -> Placement:
        return Placement((Offset(0),) * 6, Bytes(4), "broken")

    monkeypatch.setattr(plan_cli, "solve", broken)
    status, lines, err = run(str(problem_csv))
    assert (status, lines) == (1, [])
    assert err == (
        f"tidalpool plan: {problem_csv}: invalid placement, not used: buffers 0 and 1 overlap:"
        " both live over ticks [1, 2) and both hold bytes [0, 2) (0 at [0, 4), 1 at [0, 2))\n"
    )


def test_plot_writes_a_png(problem_csv: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "four.png"
    status, lines, _ = run(str(problem_csv), "--plot", str(picture))
    assert status == 0
    assert lines[-1] == f"picture: {picture}"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_exits_2_before_solving(
    problem_csv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    status, lines, err = run(str(problem_csv), "--plot", str(tmp_path / "x.png"))
    assert (status, lines) == (2, [])
    assert err == (
        f"tidalpool plan: --plot {tmp_path / 'x.png'}: drawing needs matplotlib, which is not"
        " installed (pip install matplotlib, or the dev extra)\n"
    )


def test_progress_is_held_for_a_second_then_shown() -> None:
    times = iter([0.0, 0.2, 0.7, 1.3, 2.0])
    stream = io.StringIO()
    progress = plan_cli._Progress(stream, lambda: next(times), after=1.0)
    progress("greedy: 12")
    progress("improve: 11")
    assert stream.getvalue() == ""
    progress("exact: searching")
    progress("exact: feasible")
    assert stream.getvalue() == (
        "[   0.2 s] greedy: 12\n"
        "[   0.7 s] improve: 11\n"
        "[   1.3 s] exact: searching\n"
        "[   2.0 s] exact: feasible\n"
    )


def test_main_runs_the_command(problem_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_cli.main(["plan", str(problem_csv), "--time-limit", "2"]) == 0
    printed = capsys.readouterr().out
    assert "height: 7 B (ratio 1.0000, canonical/length)\n" in printed
    assert printed.endswith("optimal: yes\n")


# -- plot ---------------------------------------------------------------------------------------

SIX = Problem(
    tuple(
        Buffer(i, Tick(lo), Tick(up), Bytes(s))
        for i, (lo, up, s) in enumerate(
            [(0, 2, 4), (1, 5, 2), (2, 6, 3), (4, 6, 1), (0, 1, 1), (3, 4, 2)]
        )
    )
)
SIX_PLACED = Placement(
    tuple(Offset(o) for o in (0, 4, 0, 3, 4, 6)), Bytes(8), "smartpool", False, {"lower_bound": 7}
)


def test_plot_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from tidaloffline.plot import plot

    path = tmp_path / "six.png"
    plot(SIX, SIX_PLACED, path, "six buffers")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_refuses_a_placement_of_another_problem(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from tidaloffline.plot import plot

    with pytest.raises(ValueError, match="5 offsets for 6 buffers: nothing to draw"):
        plot(SIX, Placement(SIX_PLACED.offsets[:5], Bytes(8), "x"), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_plot_without_matplotlib_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tidaloffline.plot import MatplotlibMissing, plot

    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MatplotlibMissing) as e:
        plot(SIX, SIX_PLACED, tmp_path / "six.png")
    assert str(e.value) == (
        f"drawing {tmp_path / 'six.png'} needs matplotlib, which is not installed"
        " (pip install matplotlib, or the dev extra)"
    )
