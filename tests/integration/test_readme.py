"""The README's Python example runs as written against a real daemon."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ..conftest import StartDaemon

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs(start_daemon: StartDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = start_daemon(device_pool="2GiB")  # the example leases 1 GiB (sparse: costs nothing)
    first, swapping = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    for code in (first, swapping):
        code = code.replace('"/tmp/tidalpool"', repr(str(daemon.socket_dir)))
        exec(compile(code, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "SessionStats(" in out
    # x and y are released in the iteration that made them
    assert "live_blocks=0, mallocs=6, frees=6" in out
    # Three 4 MiB layers under a 6 MiB limit, in pages: the daemon's plan runs, and each matmul
    # brings its layer back in as the plan says; nothing moves on demand once it runs
    assert out.splitlines()[-1].startswith("planned SwapStats(limit=6291456, "), out
    swap = re.search(r"swap_outs=(\d+), swap_ins=(\d+),.*planned_out_bytes=(\d+)", out)
    assert swap is not None, out
    assert int(swap[1]) >= 3 * 8 and int(swap[2]) >= 2 * 8 and int(swap[3]) > 0
