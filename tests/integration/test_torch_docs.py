"""docs/torch.md's examples run as written: each ```python block is run by a test (here, or
through `run_example` elsewhere) or says it is a fragment; the shell lines after the recording
example succeed on the trace it writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ..conftest import StartDaemon
from ..unit.docs_examples import DOCS, run_example

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
FRAGMENT = "# A fragment:"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", (DOCS / "torch.md").read_text(), re.S)


def keys_run_by_tests() -> set[str]:
    """What the tests pass to `run_example("torch.md", ...)`: each names the block it runs."""
    found: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        found.update(re.findall(r'run_example\(\s*"torch\.md",\s*"([^"]+)"', path.read_text()))
    return found


def test_every_python_example_is_run_or_marked_a_fragment() -> None:
    keys = keys_run_by_tests()
    assert "SavedTensors(session" in keys  # this file's own, so the scan sees tests at all
    unrun = [
        b.splitlines()[0]
        for b in blocks("python")
        if not b.startswith(FRAGMENT) and not any(key in b for key in keys)
    ]
    assert unrun == []


def test_the_saved_tensors_example_runs(
    start_daemon: StartDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = start_daemon()
    monkeypatch.setenv("TIDALPOOL_SOCKET_DIR", str(d.socket_dir))
    namespace = run_example("torch.md", "SavedTensors(session")
    stats = namespace["saved"].stats()
    swap = namespace["session"].stats().swap
    assert stats.iterations == 5 and stats.saved > 0 and stats.unpacked > 0
    assert swap is not None and swap.swap_outs > 0  # the saves went beyond 256 KiB


def test_the_in_place_example_runs(
    start_daemon: StartDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = start_daemon()
    monkeypatch.setenv("TIDALPOOL_SOCKET_DIR", str(d.socket_dir))
    namespace = run_example("torch.md", "InPlace(session")  # it asserts the bits itself
    stats = namespace["in_place"].stats()
    swap = namespace["session"].stats().swap
    assert stats.tensors == 0 and stats.saves > 0 and stats.iterations == 13  # all given back
    assert swap is not None and swap.swap_outs > 0 and swap.peak_resident_bytes <= 12 << 20


def test_the_shell_lines_after_the_recording_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tidalpool.cli import main

    monkeypatch.chdir(tmp_path)
    run_example("torch.md", "tidalpool.torch.record(")
    (shell,) = [b for b in blocks("sh") if "mlp.trace.csv" in b]
    lines = [line.split("#")[0].strip() for line in shell.splitlines()]
    assert [line.split()[1] for line in lines] == ["plan", "simulate"]
    for line in lines:
        assert main(shlex.split(line)[1:]) == 0, line
