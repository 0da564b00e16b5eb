"""bench/gpu_check.py (`make gpu-check`) without a GPU: the dry run lists every part as skipped
with the reason and writes its JSON; a part past its limit is stopped with its whole process
group and recorded as timed out; the budget and the parts' needs decide what is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from gpu_check import (  # noqa: E402
    Outcome,
    Part,
    junit_summary,
    missing_files,
    parts,
    run_all,
    run_part,
    select,
    wheel_requirements,
    wheels_missing,
)

NAMES = [
    "install",
    "imports",
    "tests-gpu",
    "conformance-cuda",
    "gpu-vmm",
    "gpu-bench",
    "gpu-bench-paged",
    "replay-resnet18.b8-0.9",
    "replay-resnet18.b8-0.7",
    "replay-resnet18.b8-0.7-paged",
    "replay-gpt2.b4.s128-0.9-paged",
    "torch-train-gpt2",
    "torch-train-resnet50",
]


def test_the_dry_run_lists_every_part_as_skipped_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    command = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run"]
    done = subprocess.run(
        [*command, "--out", str(out), "--wheels", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert [p["name"] for p in data["parts"]] == NAMES
    assert {(p["status"], p["reason"]) for p in data["parts"]} == {
        ("skipped", "dry run: asked for (--dry-run)")
    }
    assert data["dry_run"] == "asked for (--dry-run)"
    assert data["counts"] == {"passed": 0, "failed": 0, "timed out": 0, "skipped": len(NAMES)}
    assert data["plumbing"]["missing_files"] == []
    assert data["plumbing"]["wheels_missing"] == wheel_requirements()
    listed = [line.split()[0] for line in done.stdout.splitlines()[3 : 3 + len(NAMES)]]
    assert listed == NAMES  # the table, one row a part
    assert f"wrote {out}" in done.stdout


def test_every_part_names_files_that_exist_and_a_missing_one_is_named() -> None:
    found = parts(sys.executable, Path("/tmp/work"), Path(".gpu-wheels"))
    assert [p.name for p in found] == NAMES
    assert missing_files(found) == []
    ghost = Part("ghost", "reads a file that is not there", ("true",), 1, files=("no/such.csv",))
    assert missing_files([*found, ghost]) == ["no/such.csv"]


def test_a_part_past_its_limit_is_timed_out_and_its_process_group_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('holding', flush=True)\n"
        "time.sleep(600)\n"
    )
    part = Part("sleeper", "a part that never ends", (sys.executable, "-c", script), 5)
    outcome = run_part(part, tmp_path, 5, dict(os.environ))
    assert (outcome.status, outcome.reason) == ("timed out", "stopped at its limit of 5 s")
    assert outcome.returncode is None
    assert 5 <= outcome.wall_s < 60
    assert outcome.log == "sleeper.log" and "holding" in outcome.log_tail
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)


def test_what_a_finished_part_leaves_running_is_killed(tmp_path: Path) -> None:
    """A daemon whose parent exited would hold the GPU's memory through the parts after."""
    pid_file = tmp_path / "left.pid"
    script = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
    )
    part = Part("leaver", "exits, leaving a child", (sys.executable, "-c", script), 30)
    outcome = run_part(part, tmp_path, 30, dict(os.environ))
    assert (outcome.status, outcome.returncode) == ("passed", 0)
    left = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while alive(left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(left)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped by init, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_part_that_fails_keeps_its_exit_status_its_last_line_and_its_json(
    tmp_path: Path,
) -> None:
    script = "import sys; print('{\"rows\": [1, 2]}'); sys.exit('no plan for this limit')"
    part = Part("printer", "prints JSON, then fails", (sys.executable, "-c", script), 30, "-")
    outcome = run_part(part, tmp_path, 30, dict(os.environ))
    assert (outcome.status, outcome.returncode) == ("failed", 1)
    assert outcome.reason == "exit status 1: no plan for this limit"
    assert outcome.result == {"rows": [1, 2]}


def test_needs_and_the_budget_decide_what_is_skipped(tmp_path: Path) -> None:
    now = [0.0]
    ran: list[tuple[str, float]] = []

    def runner(part: Part, work: Path, limit_s: float, env: dict[str, str]) -> Outcome:
        ran.append((part.name, limit_s))
        now[0] += {"install": 30, "a": 50, "b": 15}[part.name]
        status = "failed" if part.name == "a" else "passed"
        return Outcome(part.name, part.what, list(part.command), limit_s, status)

    found = [
        Part("install", "", ("true",), 60),
        Part("a", "", ("true",), 60, needs=("install",)),
        Part("after-a", "", ("true",), 60, needs=("a",)),
        Part("b", "", ("true",), 60, needs=("install", "not-selected")),
        Part("c", "", ("true",), 60),
    ]
    seen: list[int] = []
    outcomes = run_all(
        found, tmp_path, 100, {}, runner, lambda o: seen.append(len(o)), lambda: now[0]
    )
    assert ran == [("install", 60), ("a", 60), ("b", 20)]  # b gets what is left of 100 s
    assert [(o.name, o.status, o.reason) for o in outcomes] == [
        ("install", "passed", ""),
        ("a", "failed", ""),
        ("after-a", "skipped", "needs a, which failed"),
        ("b", "passed", ""),
        ("c", "skipped", "the budget of 100 s was spent (5 s left)"),
    ]
    assert seen == [1, 2, 3, 4, 5]  # the JSON is written after every part


def test_only_and_skip_select_parts_by_name_or_prefix() -> None:
    found = parts(sys.executable, Path("/tmp/work"), Path(".gpu-wheels"))
    chosen = select(found, ["replay-resnet18*", "gpu-vmm"], ["replay-resnet18.b8-0.7"])
    assert [p.name for p in chosen] == [
        "gpu-vmm",
        "replay-resnet18.b8-0.9",
        "replay-resnet18.b8-0.7-paged",
    ]
    with pytest.raises(SystemExit, match="no part is named 'replay'"):
        select(found, ["replay"], [])


def test_a_junit_file_is_summed_up_with_each_failure_and_skip(tmp_path: Path) -> None:
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.a" name="test_ok" time="1"/>'
        '<testcase classname="tests.gpu.a" name="test_bad" time="1">'
        '<failure message="assert 1467940864 == 1467875328&#10;more">trace</failure></testcase>'
        '<testcase classname="tests.gpu.b" name="test_two_gpus" time="0">'
        '<skipped message="needs two GPUs"/></testcase>'
        '<testcase classname="tests.gpu.b" name="test_broken" time="0">'
        '<error message="fixture failed"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert junit_summary(xml) == {
        "passed": 1,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
        "failures": [
            {"test": "tests.gpu.a::test_bad", "message": "assert 1467940864 == 1467875328"},
            {"test": "tests.gpu.b::test_broken", "message": "fixture failed"},
        ],
        "skips": [{"test": "tests.gpu.b::test_two_gpus", "reason": "needs two GPUs"}],
    }


def test_the_wheels_are_matched_by_name_and_version_and_the_doc_lists_them(
    tmp_path: Path,
) -> None:
    wanted = wheel_requirements()
    assert "grpcio==1.85.3" in wanted and "protobuf==7.36.2" in wanted
    (tmp_path / "grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.whl").touch()
    (tmp_path / "typing_extensions-4.16.0-py3-none-any.whl").touch()
    (tmp_path / "protobuf-7.35.1-cp310-abi3-manylinux2014_x86_64.whl").touch()  # not the pin
    missing = wheels_missing(tmp_path)
    assert missing == [
        r for r in wanted if r not in ("grpcio==1.85.3", "typing-extensions==4.16.0")
    ]
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    section = doc.split("## GPU check (`make gpu-check`)")[1].split("\n## ")[0]
    assert [r for r in wanted if f"`{r}`" not in section] == []
