"""`tidalpool replay`: the script it runs, its stamps, its report, and clear refusals of bad
input, all without a daemon (the runs against one are in tests/integration/test_replay.py)."""

from __future__ import annotations

import importlib.util
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from tidalclient.devices.streams import Stream
from tidaloffline.replay.compute import Mark, SimCompute, places, stamp
from tidaloffline.replay.replayer import Record, script
from tidaloffline.replay.report import Report
from tidaloffline.replay.session import lease_bytes
from tidaloffline.simulate_command import load
from tidalpool.cli import main

MiB = 1 << 20


def small_trace(path: Path) -> Path:
    """Two weights of 1 MiB; per iteration: x (1 MiB) loaded, y (2 MiB) computed from x and w1,
    w2 updated from y, and a 4 KiB buffer z written last and freed in the next iteration."""
    lines = ["kind,id,size,ns,name", f"alloc,1,{MiB},,", f"alloc,2,{MiB},,"]
    for k in range(3):
        x, y, z = 10 + 10 * k, 11 + 10 * k, 12 + 10 * k
        lines += [f"iter,{k},,,"]
        lines += [f"free,{z - 10},,,"] if k else []
        lines += [f"alloc,{x},{MiB},,", f"write,{x},,,", "op,1,,1000000,load"]
        lines += [f"alloc,{y},{2 * MiB},,", f"read,{x},,,", "read,1,,,", f"write,{y},,,"]
        lines += ["op,2,,2000000,fwd", f"free,{x},,,"]
        lines += [f"read,{y},,,", "read,2,,,", "write,2,,,", "op,3,,1000000,sgd"]
        lines += [f"free,{y},,,", f"alloc,{z},4096,,", f"write,{z},,,", "op,4,,0,tail"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_script_runs_each_tick_of_the_iteration(tmp_path: Path) -> None:
    it = load(small_trace(tmp_path / "small.trace.csv"))
    s = script(it)
    # tick: 0 free z (last iteration's), 1 alloc x, 2 load, 3 alloc y, 4 fwd, 5 free x, 6 sgd,
    # 7 free y, 8 alloc z, 9 tail.
    assert s.ticks == 10
    assert s.at == (
        None,
        ("alloc", 0),
        ("op", 0),
        ("alloc", 1),
        ("op", 1),
        None,
        ("op", 2),
        None,
        ("alloc", 2),
        ("op", 3),
    )
    assert s.frees == ((0, 5), (0, 7), (1, 0))  # z: tick 0 of the next iteration
    assert s.reads == (
        (),
        (("block", 0, 0), ("persistent", 0, 0)),
        (("block", 1, 0), ("persistent", 1, 0)),
        (),
    )
    assert s.writes == (
        (("block", 0, 0),),
        (("block", 1, 0),),
        (("persistent", 1, 0),),
        (("block", 2, 0),),
    )
    assert s.unresolved == 0


def test_an_access_to_a_reused_id_names_the_previous_instance(tmp_path: Path) -> None:
    """Block 9 is allocated at the end of each iteration and read, under the same id, by the
    next iteration's first op, then freed: that read is of the previous instance (age 1)."""
    lines = ["kind,id,size,ns,name"]
    for k in range(3):
        lines += [f"iter,{k},,,"]
        lines += ["read,9,,,", "op,1,,10,use", "free,9,,,"] if k else []
        lines += ["alloc,9,512,,", "write,9,,,", "op,2,,10,make"]
    path = tmp_path / "reuse.trace.csv"
    path.write_text("\n".join(lines) + "\n")
    s = script(load(path))
    assert s.at == (("op", 0), None, ("alloc", 0), ("op", 1))
    assert s.frees == ((1, 1),)
    assert s.reads == ((("block", 0, 1),), ())
    assert s.writes == ((), (("block", 0, 0),))


def test_stamps_sit_at_the_start_middle_and_end_and_name_serial_and_writes() -> None:
    assert places(1) == (0,)
    assert places(127) == (0,)
    assert places(128) == (0, 64)  # start and end, touching
    assert places(191) == (0, 127)
    assert places(192) == (0, 64, 128)
    assert places(4 * MiB) == (0, 2 * MiB - 32, 4 * MiB - 64)
    words = np.frombuffer(stamp(3, 2, 64), "<u8")
    base = (3 << 32) | 2
    magic = 0x7469_6461_6C70_6F6F
    assert words.tolist() == [(base ^ (magic * (j + 1))) % (1 << 64) for j in range(8)]
    assert stamp(3, 2, 16) == stamp(3, 2, 64)[:16]  # a small block holds what fits
    assert stamp(3, 2, 64) != stamp(3, 3, 64) != stamp(4, 2, 64)


def test_sim_compute_writes_stamps_and_counts_the_wrong_ones() -> None:
    stream = Stream("compute")
    try:
        compute = SimCompute(stream)
        a = np.zeros(4096, np.uint8)
        b = np.zeros(100, np.uint8)
        compute.run(0, [], [Mark(a, a.size, 1, 1), Mark(b, b.size, 2, 1)])
        compute.run(1000, [Mark(a, a.size, 1, 1), Mark(b, b.size, 2, 1)], [])
        compute.synchronize()
        assert compute.counts() == (0, 4)  # three stamps of a, one of b
        assert a[2016:2080].tobytes() == stamp(1, 1, 64)
        a[4095] ^= 1  # the last stamp's last byte
        compute.run(0, [Mark(a, a.size, 1, 1), Mark(b, b.size, 2, 2)], [])
        compute.synchronize()
        assert compute.counts() == (2, 8)  # a's end, and b expected at its second write
    finally:
        stream.close()


def _record(index: int, phase: str, step_ms: int, out_mib: int) -> Record:
    return Record(
        index=index,
        phase=phase,
        mode="learning" if phase == "learning" else "planned",
        step_ns=step_ms * 1_000_000,
        planned_out_bytes=0 if phase == "learning" else out_mib * MiB,
        planned_in_bytes=0 if phase == "learning" else out_mib * MiB,
        on_demand_out_bytes=out_mib * MiB if phase == "learning" else 0,
        on_demand_in_bytes=out_mib * MiB if phase == "learning" else 0,
        stall_ns=1_000_000,
        piece_misses=0,
        footprint_bytes=8 * MiB,
        mismatches=0,
        stamps_checked=10,
        not_resident=0,
    )


def test_the_report_averages_the_steady_iterations_only() -> None:
    report = Report(
        trace="t.csv",
        backend="sim",
        daemon="started",
        limit_bytes=12 * MiB,
        peak_bytes=16 * MiB,
        op_bound_bytes=4 * MiB,
        compute_scale=2.0,
        copy_gbps=1.0,
        records=[
            _record(0, "learning", 90, 6),
            _record(1, "switch", 50, 4),
            _record(2, "steady", 40, 4),
            _record(3, "steady", 44, 4),
        ],
        predicted={"step_ns": 40_000_000, "out_bytes": 4 * MiB, "in_bytes": 4 * MiB},
    )
    got = report.as_json()
    assert (got["iterations"], got["learning_iterations"], got["steady_iterations"]) == (4, 1, 2)
    m = got["measured"]
    assert m["step_ns"] == 42_000_000
    assert m["out_bytes"] == m["planned_out_bytes"] == 4 * MiB
    assert m["on_demand_out_bytes"] == m["on_demand_in_bytes"] == 0
    assert got["step_ratio"] == pytest.approx(1.05)
    assert got["checks"]["stamps_checked"] == 40
    assert [r["phase"] for r in got["per_iteration"]] == ["learning", "switch", "steady", "steady"]


def test_the_lease_holds_the_peak_and_a_quarter_in_whole_chunks() -> None:
    assert lease_bytes(16 * MiB) == 22 * MiB  # 16 + 4 + 2: whole 2 MiB chunks
    assert lease_bytes(17 * MiB) == 24 * MiB  # 23.25 MiB, rounded up
    assert lease_bytes(1) == 4 * MiB


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "abc"], "--limit abc:"),
        (["--limit", "0"], "--limit 0: a fraction must be above 0"),
        (["--limit", "0.3"], "is below 4 MiB, the bytes one op of the iteration accesses at once"),
        (["--limit", "0.9", "--iterations", "4"], "--iterations must be at least 5"),
        (["--limit", "0.9", "--compute-scale", "0"], "--compute-scale must be positive"),
        (["--limit", "0.9", "--copy-gbps", "-1"], "--copy-gbps must be positive"),
        (["--limit", "0.9", "--plan-timeout", "inf"], "--plan-timeout must be a positive"),
        (["--limit", "0.9", "--backend", "cuda", "--page", "64KiB"], "use --page 2MiB"),
        (["--limit", "0.9", "--device-min", "8MiB"], "--device-min makes an elastic lease"),
        (["--limit", "0.9", "--device-lease", "0"], "--device-lease must be a positive size"),
        (["--limit", "0.9", "--device-min", "lots", "--page", "64KiB"], "--device-min: "),
        (
            ["--limit", "0.9", "--page", "64KiB", "--device-min", "8MiB", "--device-lease", "8MiB"],
            "give one",
        ),
    ],
)
def test_bad_options_are_named(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = small_trace(tmp_path / "small.trace.csv")  # peak 5 MiB and 4 KiB, fwd accesses 4 MiB
    assert main(["replay", str(trace), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tidalpool replay: ") and message in err


def test_the_limit_is_required(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["replay", str(small_trace(tmp_path / "t.csv"))])
    assert raised.value.code == 2
    assert "the following arguments are required: --limit" in capsys.readouterr().err


def test_bad_traces_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "nope.csv"), "--limit", "0.5"]) == 2
    assert "nope.csv: no such file" in capsys.readouterr().err
    problem = tmp_path / "problem.csv"
    problem.write_text("id,lower,upper,size\n1,0,2,4\n")
    assert main(["replay", str(problem), "--limit", "0.5"]) == 2
    assert capsys.readouterr().err == (
        f"tidalpool replay: {problem}: a placement CSV; replay reads a trace CSV v1 (header"
        " kind,id,size,ns,name, with ops), as tidalpool.torch.record writes it\n"
    )


def test_no_daemon_at_the_socket_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = small_trace(tmp_path / "small.trace.csv")
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as empty:
        assert main(["replay", str(trace), "--limit", "0.9", "--socket-dir", empty]) == 2
        err = capsys.readouterr().err
        assert f"tidalpool replay: no daemon answers at {empty}" in err
        # The command's own --socket-dir, before the subcommand, is the same.
        assert main(["--socket-dir", empty, "replay", str(trace), "--limit", "0.9"]) == 2
        assert f"no daemon answers at {empty}" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_a_cuda_replay_without_cupy_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = small_trace(tmp_path / "small.trace.csv")
    assert main(["replay", str(trace), "--limit", "0.9", "--backend", "cuda"]) == 2
    assert "a cuda replay runs its ops as CuPy kernels: install CuPy" in capsys.readouterr().err


DOC = (Path(__file__).resolve().parents[2] / "docs" / "replay.md").read_text()


def test_the_doc_names_every_option_and_field_and_no_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    known = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out)) - {"--help"}
    assert set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", DOC)) == known
    fields = DOC.split("| field | meaning |")[1].split("\n\n")[0]
    named = {
        n
        for cell in re.findall(r"^\| (.*?) \|", fields, re.M)
        for n in re.findall(r"`(\w+)`", cell)
    }
    report = Report("t", "sim", "started", 1, 1, 1, 1.0, None, [_record(0, "steady", 1, 1)])
    assert set(report.as_json()) <= named
