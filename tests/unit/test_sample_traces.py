"""The sample traces of traces/: small enough for git, read by `tidalpool plan` and `simulate`,
the README's examples of both run as written on them, and `traces/record.py` (`make traces`)
writes the same bytes again."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest
from tidalpool.cli import main

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "traces"
SAMPLES = {
    "mlp.b64.trace.csv": "model=Sequential batch=(64, 1, 28, 28) float32, (64,) int64"
    " optimizer=SGD",
    "resnet18.b8.trace.csv": "model=Sequential batch=(8, 3, 224, 224) float32, (8,) int64"
    " optimizer=SGD",
    "gpt2.b4.s128.trace.csv": "model=GPT2 batch=(4, 128) int64, (512,) int64 optimizer=AdamW",
}


def test_the_samples_are_there_small_and_of_three_iterations() -> None:
    assert sorted(p.name for p in TRACES.glob("*.csv")) == sorted(SAMPLES)
    for name, what in SAMPLES.items():
        path = TRACES / name
        assert path.stat().st_size < 512 * 1024, name
        lines = path.read_text().splitlines()
        assert lines[0] == f"# tidalpool trace v1; {what} iters=3"
        assert sum(1 for line in lines if line.startswith("iter,")) == 3


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_plan_and_simulate_read_each(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = TRACES / name
    assert main(["plan", str(path), "--out", str(tmp_path / "solution.csv")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "steady: iteration 1 of 3 (iteration 2 repeats it)"
    assert "optimal: yes" in out
    assert main(["simulate", str(path), "--policy", "tidalpool", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["policies"]
    assert row["feasible"] and row["peak_bytes"] <= report["limit_bytes"]


def readme_commands() -> list[list[str]]:
    """The `tidalpool plan` and `tidalpool simulate` lines of the README's shell examples."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if re.match(r"tidalpool (plan|simulate) ", line)]


def test_the_readme_examples_run_as_written_from_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = readme_commands()
    assert [argv[:2] for argv in commands] == [["tidalpool", "plan"], ["tidalpool", "simulate"]]
    (tmp_path / "traces").symlink_to(TRACES)  # the repository's files, its outputs kept apart
    monkeypatch.chdir(tmp_path)
    solution = tmp_path / "gpt2.solution.csv"
    for argv in commands:
        inputs = [a for a in argv if a.endswith(".trace.csv")]
        assert inputs and all((ROOT / a).resolve().is_relative_to(ROOT) for a in inputs), argv
        if "--out" in argv:  # written outside the checkout: here, this test's own directory
            written = Path(argv[argv.index("--out") + 1])
            assert written.is_absolute() and not written.is_relative_to(ROOT), argv
            argv = [str(solution) if a == str(written) else a for a in argv]
        assert main(argv[1:]) == 0, argv
    out = capsys.readouterr().out
    assert "steady: iteration 1 of 3 (iteration 2 repeats it)" in out
    assert solution.read_text().startswith("id,lower,upper,size,offset\n")


def recorder(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """traces/record.py as a module (in sys.modules while the test runs, as dataclasses ask)."""
    spec = importlib.util.spec_from_file_location("traces_record", TRACES / "record.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_make_traces_writes_the_same_mlp_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    written = recorder(monkeypatch).record("mlp", tmp_path)
    assert written.read_bytes() == (TRACES / "mlp.b64.trace.csv").read_bytes()
