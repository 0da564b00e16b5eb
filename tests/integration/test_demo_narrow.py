"""`tidalpool demo` at 80 columns: its table whole, one row per iteration, every line within
the width, each path on one line, and the trace column explained."""

from __future__ import annotations

import re
import tempfile

from tidalclient.demo.run import SWAP_NOTE, TRACE_NOTE

from .test_cli import run_cli

COLUMNS = ["iter", "loss", "mode", "live", "footprint", "plan hits", "misses", "trace"]


def test_the_demo_reads_at_80_columns() -> None:
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as missing:
        out = run_cli("demo", env={"TIDALPOOL_SOCKET_DIR": missing, "COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80, out.stdout
    assert lines[0] == f"no daemon answers at {missing}"
    assert re.fullmatch(r"starting a sim daemon in /tmp/tidalpool-demo-\S+", lines[1]), lines[1]
    (header,) = [line for line in lines if line.startswith("iter ")]
    assert re.split(r"\s{2,}", header.strip()) == COLUMNS  # one table: no column left over
    rows = [line.split() for line in lines if re.match(r" *\d+ +\d+\.\d{6} ", line)]
    assert [row[0] for row in rows] == [str(i) for i in range(20)]
    for row in rows:  # iter, loss, mode, live and footprint (two words each), hits, misses, trace
        assert len(row) == 10 and re.fullmatch(r"[\d,]+/[\d,]+", row[-1]), row
    assert TRACE_NOTE in " ".join(out.stdout.split())


def test_the_swapping_demo_reads_at_80_columns_in_one_table() -> None:
    """Under a limit the table shows what each iteration moved, and still fits 80 columns."""
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as missing:
        out = run_cli(
            "demo",
            "--limit",
            "0.6",
            "--iterations",
            "8",
            env={"TIDALPOOL_SOCKET_DIR": missing, "COLUMNS": "80"},
        )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80, out.stdout
    (header,) = [line for line in lines if line.startswith("iter ")]
    want = ["iter", "loss", "mode", "device", "out", "in", "stall", "trace"]
    assert re.split(r"\s{2,}", header.strip()) == want  # one table: no column left over
    rows = [line.split() for line in lines if re.match(r" *\d+ +\d+\.\d{6} ", line)]
    assert [row[0] for row in rows] == [str(i) for i in range(8)]
    for row in rows:  # iter, loss, mode, three sizes (two words each), the stall, trace
        assert len(row) == 12 and row[-2] == "ms", row
    text = " ".join(out.stdout.split())
    assert TRACE_NOTE in text and SWAP_NOTE in text
