"""What the commands print is read by people: tables fit the terminal or fold, never cut a
value nor share a header; numbers say what they count so that they add up across commands;
options mean what users of memory tools expect; every refusal is one line and an exit status."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import pytest
from rich.console import Console
from tidalclient.status import as_json, render
from tidalclient.tables import Fitted
from tidalclient.top import Sample, view
from tidalcore.v1 import admin_pb2
from tidalpool.cli import main

from ..conftest import shared_file
from .test_top import pool

MiB, GiB = 1 << 20, 1 << 30
WIDTHS = (200, 120, 80, 60, 40)
POLICIES = [f"autoswap-{s}" for s in ("doa", "aoa", "wdoa", "swdoa", "bo")]


def _vgg() -> str:
    return str(shared_file("traces/models/vgg16.b32.trace.csv"))


def _resnet() -> str:
    return str(shared_file("traces/models/resnet50.b32.trace.csv"))


def printed(renderable: object, width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue().splitlines()


def assert_readable(lines: list[str], width: int, values: list[str]) -> None:
    """No line wider than `width`, nothing cut short, every value whole on some line."""
    assert all(len(line) <= width for line in lines), [x for x in lines if len(x) > width]
    text = "\n".join(lines)
    assert "…" not in text
    for value in values:
        assert value in text, f"{value!r} is not printed whole at {width} columns"


# -- tables --------------------------------------------------------------------------------------


def _sweep_like() -> Fitted:
    headers = ["limit", "bound", *POLICIES, "vdnn-all", "vdnn-conv", "vdnn-dyn", "tidalpool"]
    rows = [
        [f"{f}%", f"{f / 10:.1f}%", *(f"{1000 * k + f + 0.5:.1f}%" for k in range(9))]
        for f in (100, 90, 80, 70)
    ]
    return Fitted(headers, rows)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_table_fits_every_width_and_keeps_every_value_whole(width: int) -> None:
    table = _sweep_like()
    assert_readable(printed(table, width), width, [c for row in table.rows for c in row])


def test_layouts_whole_then_folded_headers_then_groups_then_records() -> None:
    table = _sweep_like()
    whole = printed(table, 200)
    assert sum(1 for line in whole if "autoswap-swdoa" in line) == 1  # one header line
    folded = printed(table, 120)  # the policies' headers broken after their hyphens
    assert any(re.search(r"autoswap- .*autoswap- ", line) for line in folded)
    assert not any("autoswap-swdoa" in line for line in folded)
    assert any(line.rstrip().endswith("swdoa ┃") or "swdoa" in line for line in folded)
    grouped = printed(table, 60)  # tables stacked, each led by the limits
    assert sum(1 for line in grouped if line.startswith("┏")) >= 2
    assert sum(1 for line in grouped if line.startswith("│ 100%")) >= 2
    records = printed(table, 20)  # too narrow to align: each value under its header
    assert records[:5] == ["100%", "  bound", "    10.0%", "  autoswap-doa", "    100.5%"]
    wide_name = Fitted(
        ["policy", "overhead", "peak"], [["portfolio (tidalpool)", "1366.9%", "2.3 GiB"]]
    )
    assert printed(wide_name, 30) == [
        "portfolio (tidalpool)",
        "  overhead  1366.9%",
        "  peak      2.3 GiB",
    ]


def test_folded_headers_stay_distinct() -> None:
    table = _sweep_like()
    folded = [table._header(j, folded=True) for j in range(len(table.headers))]
    assert len(set(folded)) == len(folded)
    assert folded[2:7] == ["autoswap-\ndoa", "autoswap-\naoa", "autoswap-\nwdoa",
                           "autoswap-\nswdoa", "autoswap-\nbo"]  # fmt: skip
    with pytest.raises(ValueError, match="two columns share a header"):
        Fitted(["a", "a"], [])


# -- status and top ------------------------------------------------------------------------------


def _pool() -> admin_pb2.PoolStatusResponse:
    p = pool()
    p.host.total_bytes, p.host.free_bytes = 5 * GiB, 5 * GiB
    p.facts["device"] = "sim"
    return p


def _sessions() -> admin_pb2.ListSessionsResponse:
    listed = admin_pb2.ListSessionsResponse()
    for k in range(2):
        s = listed.sessions.add(
            session_id=f"s{k}-7f3a9c", job_name="train-resnet50-b32", pid=4321, state="attached",
            device_used_bytes=3 * MiB, device_peak_bytes=5 * GiB + 17, events_received=1234567,
            iterations_seen=17, swapped_out_bytes=12 * GiB, swap_limit_bytes=48 * MiB,
        )  # fmt: skip
        s.lease.device.length = 64 * MiB
        s.lease.device.chunks.extend(range(32))
    return listed


@pytest.mark.parametrize("width", WIDTHS)
def test_status_fits_the_terminal(width: int) -> None:
    out = io.StringIO()
    render(_pool(), _sessions(), Console(file=out, width=width, color_system=None))
    values = ["256 MiB", "64 MiB (32 chunks)", "5 GiB", "1,234,567", "train-resnet50-b32"]
    assert_readable(out.getvalue().splitlines(), width, values)


@pytest.mark.parametrize("width", WIDTHS)
def test_top_fits_the_terminal(width: int) -> None:
    now = Sample(time.monotonic(), _pool(), tuple(_sessions().sessions))
    values = ["256 MiB", "12 GiB", "48 MiB", "train-resnet50-b32", "25 %"]
    assert_readable(printed(view(now, None, 0.5), width), width, values)


def test_status_json_gives_byte_counts_as_numbers() -> None:
    got = json.loads(as_json(_pool(), _sessions()))
    device = got["pool"]["device"]
    assert device == {
        "total_bytes": 256 * MiB,
        "leased_bytes": 64 * MiB,
        "free_bytes": 192 * MiB,
        "used_bytes": 0,
        "quarantined_bytes": 0,
    }
    assert got["pool"]["chunk_bytes"] == 2 * MiB and got["pool"]["facts"] == {"device": "sim"}
    assert isinstance(got["pool"]["started_unix_ns"], int)
    first = got["sessions"][0]
    assert first["device_peak_bytes"] == 5 * GiB + 17
    assert first["events_received"] == 1234567
    assert first["lease"]["device"]["length"] == 64 * MiB
    assert first["lease"]["device"]["chunks"] == list(range(32))
    assert first["swapped_in_bytes"] == 0  # zeros are printed, not left out


# -- simulate and plan, as piped (80 columns) ----------------------------------------------------


def test_simulate_sweep_piped_fits_80_columns_and_keeps_every_overhead(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    argv = ["simulate", _vgg(), "--sweep", "--step", "0.3", "--policy", ",".join(POLICIES)]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    overheads = {
        f"{100 * p['overhead']:.1f}%" for s in got["sweep"] for p in s["policies"] if p["feasible"]
    }
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert_readable(lines, 80, sorted(overheads))
    assert "2149.0%" in overheads or "3935.5%" in overheads  # wide values were asked about


def test_simulate_table_piped_fits_80_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    argv = ["simulate", _vgg(), "--limit", "0.7", "--policy", "autoswap-doa,tidalpool"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert_readable(lines, 80, ["portfolio (tidalpool)", "yes, for 2.2 GiB", "3935.5%", "38.351"])


# -- the numbers add up ----------------------------------------------------------------------------


def test_plan_bound_plus_persistent_is_the_peak_simulate_reports(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", _resnet(), "--no-exact", "--time-limit", "2"]) == 0
    out = capsys.readouterr().out
    bound = int(re.search(r"^lower bound: (\d+) B \(2.6 GiB\): the arena", out, re.M)[1])  # type: ignore[index]
    persistent = int(re.search(r"^persistent: (\d+) B \(213.6 MiB\): 483 blocks", out, re.M)[1])  # type: ignore[index]
    total = int(re.search(r"^lower bound \+ persistent: (\d+) B \(2.8 GiB\)", out, re.M)[1])  # type: ignore[index]
    assert (bound, persistent, total) == (2776539136, 223975424, 3000514560)
    assert main(["simulate", _resnet(), "--policy", "vdnn-conv", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["unconstrained_peak_bytes"] == total
    assert got["persistent_bytes"] == persistent
    assert got["transient_peak_bytes"] == bound
    assert main(["simulate", _resnet(), "--policy", "vdnn-conv"]) == 0
    text = capsys.readouterr().out
    assert "peak, no limit  2.8 GiB, the sum of" in text
    assert "persistent    213.6 MiB: live across iterations" in text
    assert "iteration     2.6 GiB: its blocks at their most (plan's bound)" in text
    assert "both include the 213.6 MiB of persistent blocks" in text


# -- options -----------------------------------------------------------------------------------


def _one_line(err: str) -> str:
    """The one line of a refusal (progress lines, "[  0.1 s] ...", aside)."""
    lines = [line for line in err.splitlines() if not re.match(r"\[ *[\d.]+ s\] ", line)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_limit_no_plan_can_fit_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", _vgg(), "--limit", "2"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        "tidalpool simulate: --limit 2: 2 B is under the op-wise bound 1.1 GiB (30% of the peak),"
        " the bytes one op needs at once: no plan fits it (a number above 1 is bytes; a fraction"
        " of the peak is at most 1, e.g. 0.6)"
    )
    assert main(["simulate", _vgg(), "--sweep", "--limit", "0.2"]) == 2
    assert "under the op-wise bound" in _one_line(capsys.readouterr().err)


def test_a_limit_under_a_cross_entropy_names_it_and_how_to_split_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The biggest op named in the refusal; a cross-entropy's can run in parts (plan_split)."""
    lines = ["kind,id,size,ns,name", "alloc,1,4096,,"]
    for k in range(3):
        x, p, g = (10 * k + 10 + i for i in range(3))
        lines += [
            f"iter,{k},,,",
            f"alloc,{x},8192,,",
            f"write,{x},,,",
            "op,0,,1000,aten.mm.default",
        ]
        lines += [f"alloc,{p},8192,,", f"read,{x},,,", f"write,{p},,,"]
        lines += ["op,0,,1000,aten._log_softmax.default", f"alloc,{g},8192,,", f"read,{p},,,"]
        lines += [
            f"read,{x},,,",
            f"write,{g},,,",
            "op,0,,1000,aten._log_softmax_backward_data.default",
        ]
        lines += [f"read,{g},,,", "read,1,,,", "write,1,,,", "op,0,,1000,aten.mm.default"]
        lines += [f"free,{g},,,", f"free,{p},,,", f"free,{x},,,"]
    trace = tmp_path / "loss.trace.csv"
    trace.write_text("\n".join(lines) + "\n")
    assert main(["simulate", str(trace), "--limit", "0.5"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.endswith(
        "no plan fits it (_log_softmax_backward_data: a cross-entropy, which can run in parts"
        " over the batch (tidalpool.torch.plan_split, docs/torch.md))"
    ), line


def test_no_feasible_plan_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", _vgg(), "--limit", "0.45", "--policy", "vdnn-all", "--json"]) == 3
    captured = capsys.readouterr()
    assert not json.loads(captured.out)["policies"][0]["feasible"]
    assert captured.err.splitlines()[-1] == (
        "tidalpool simulate: no policy's plan fits 1.7 GiB (45% of the peak)"
    )


def test_a_sweep_stops_at_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", _resnet(), "--sweep", "--step", "0.3", "--policy", "autoswap-doa"]
    assert main([*argv, "--limit", "0.5", "--json"]) == 0
    fractions = [round(s["fraction"], 2) for s in json.loads(capsys.readouterr().out)["sweep"]]
    assert fractions == [1.0, 0.7]  # 0.4 is under the sweep's lowest limit


def test_help_states_the_size_rule_and_the_sweeps_use_of_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "4g = 4GiB = 4×1024³ bytes, 4GB = 4×10⁹ bytes" in text
    assert "With --sweep: the sweep's lowest limit (default the op-wise bound)" in text
    assert "Every option has a default." in text


def test_4g_is_four_gibibytes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", _resnet(), "--limit", "4g", "--policy", "vdnn-conv", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["limit_bytes"] == 4 * GiB


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--sweep", "--timeline", "t.json"],
            "--timeline writes the step at one limit: leave out --sweep",
        ),
        (
            ["--plot", "no/such/dir/p.png"],
            "--plot no/such/dir/p.png: no such directory no/such/dir",
        ),
        (
            ["--sweep", "--limit", "5GiB"],
            "--limit 5GiB: 5 GiB is above the peak 3.8 GiB, where a sweep starts: with --sweep,"
            " --limit is its lowest limit",
        ),
        (
            ["--limit", "4XB"],
            "--limit 4XB: unknown size unit 'XB' in '4XB' (accepted: B; k, m, g, t,",
        ),
    ],
)
def test_refusals_are_one_line(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", _vgg(), *args]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"tidalpool simulate: {message}")


def test_an_output_that_cannot_be_written_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "a-directory.json"
    target.mkdir()
    argv = ["simulate", _vgg(), "--policy", "vdnn-conv", "--json", "--timeline"]
    assert main([*argv, str(target)]) == 2  # refused before any plan is made
    assert _one_line(capsys.readouterr().err) == (
        f"tidalpool simulate: --timeline {target}: a directory, not a file"
    )
    from tidaloffline import timeline

    def refused(path: str | Path, *args: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(timeline, "write", refused)
    assert main([*argv, str(tmp_path / "t.json")]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"tidalpool simulate: {tmp_path / 't.json'}: cannot write: Permission denied"
    )
    assert main(["plan", _vgg(), "--annotate", "-1"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        "tidalpool plan: --annotate must be 0 or more, got -1"
    )
