"""The examples of docs/ run as written (torch.md has test_torch_docs.py; benchmarks.md holds
dated records, not examples): every fenced block names its language, every ```sh and ```python
block is run here or begins with `# A fragment:` and why, and what a fragment names of the
repository exists. The shell lines run on the sim backend from the repository's root, with
/run/tidalpool replaced by a temporary directory where a daemon serves."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidalclient.local import LocalDaemon

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXEMPT = {"benchmarks.md", "torch.md"}
PAGES = sorted(p.name for p in DOCS.glob("*.md") if p.name not in EXEMPT)
FRAGMENT = "# A fragment:"
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.S | re.M)
RUN_DIR = "/run/tidalpool"


def fences(page: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block of docs/`page`."""
    return FENCE.findall((DOCS / page).read_text())


def example(page: str, containing: str, language: str = "sh") -> str:
    """The one block of docs/`page` in `language` that contains `containing`."""
    (body,) = [b for lang, b in fences(page) if lang == language and containing in b]
    return body


def keys_run_here() -> set[tuple[str, str]]:
    """The (page, containing) of every `example(...)` call of this file: the blocks it runs."""
    return set(re.findall(r'example\(\s*"([\w.]+)",\s*"([^"]+)"', Path(__file__).read_text()))


def tidalpool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tidalpool", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def command(line: str, run_dir: Path) -> list[str]:
    """A shell line of a doc as arguments of `tidalpool`, comment dropped, /run/tidalpool
    replaced by `run_dir`."""
    words = shlex.split(line.replace(RUN_DIR, str(run_dir)), comments=True)
    assert words[0] == "tidalpool", line
    return words[1:]


@pytest.fixture(scope="module")
def run_dir() -> Iterator[Path]:
    """A stand-in for /run/tidalpool: a sim daemon serves in its gpu0, and gpu1 has none."""
    base = Path(tempfile.mkdtemp(prefix="tp-docs-", dir="/tmp"))  # socket paths stay short
    daemon = LocalDaemon.start(
        base / "gpu0", device_pool="256MiB", host_pool="256MiB", chunk_size="2MiB"
    )
    yield base
    daemon.stop()
    shutil.rmtree(base, ignore_errors=True)


def test_the_pages_are_found() -> None:
    assert {"operations.md", "replay.md", "native.md"} <= set(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_every_fence_names_its_language(page: str) -> None:
    """Diagrams and output are ```text; an example in a language without a runner here
    (bash, console, yaml...) fails until it gets one."""
    languages = [lang for lang, _ in fences(page)]
    assert set(languages) <= {"text", "sh", "python"}, languages
    assert (DOCS / page).read_text().count("\n```") == 2 * len(languages)  # none unparsed


@pytest.mark.parametrize("page", PAGES)
def test_every_example_is_run_or_marked_a_fragment(page: str) -> None:
    run = keys_run_here()
    assert ("replay.md", "traces/resnet18") in run  # the scan sees this file's calls
    unrun = [
        body.splitlines()[0]
        for lang, body in fences(page)
        if lang != "text"
        and not body.startswith(FRAGMENT)
        and not any(p == page and key in body for p, key in run)
    ]
    assert unrun == []


@pytest.mark.parametrize("page", PAGES)
def test_what_the_fragments_name_of_the_repository_exists(page: str) -> None:
    """A shell fragment is not run, but the files and folders it names (relative paths, outside
    the virtualenv) are there."""
    named = [
        word
        for lang, body in fences(page)
        if lang == "sh" and body.startswith(FRAGMENT)
        for line in body.replace("\\\n", " ").splitlines()[1:]  # continued lines joined
        for word in shlex.split(line, comments=True)
        if "/" in word and not word.startswith(("/", ".")) and not re.search(r"[:=]", word)
    ]
    missing = [word for word in named if not (ROOT / word).exists()]
    assert missing == []
    if page == "operations.md":
        assert "deploy/systemd/tidalpoold@.service" in named  # the scan sees the fragments


def test_the_replay_examples_run(run_dir: Path) -> None:
    private, against_a_daemon = example("replay.md", "traces/resnet18").splitlines()

    out = tidalpool(*command(private, run_dir))
    assert out.returncode == 0, out.stderr
    assert "starting a sim daemon" in out.stderr
    assert "steady iterations (mean of 4) against the prediction" in out.stdout
    assert re.search(r"\d+ stamps checked, 0\s+wrong, 0 accesses off the device", out.stdout)

    out = tidalpool(*command(against_a_daemon, run_dir / "gpu0"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["daemon"] == str(run_dir / "gpu0")  # that directory's daemon, no private one
    assert report["outcome"] == "compared"
    assert report["limit_bytes"] == 24 << 20
    assert report["steady_iterations"] >= 1
    assert report["checks"]["mismatches"] == report["checks"]["not_resident"] == 0


def test_the_replay_refusal_reads_as_shown() -> None:
    """The stderr line shown for resnet18 at --limit 0.31 and --copy-gbps 12, after its three
    learning iterations, with exit status 2."""
    shown = example("replay.md", "cannot plan this session", "text").strip()
    prose = (DOCS / "replay.md").read_text()
    assert "`traces/resnet18.b8.trace.csv` at `--limit 0.31`" in prose
    out = tidalpool(
        "replay", "traces/resnet18.b8.trace.csv", "--limit", "0.31", "--copy-gbps", "12", "--json"
    )
    assert out.returncode == 2, out.stderr
    assert shown in out.stderr.splitlines()
    report = json.loads(out.stdout)
    assert report["iterations"] == report["learning_iterations"] == 3
    assert report["plan_unavailable"]["kind"] == "no_schedule"
    assert f"op-wise bound of {report['op_bound_bytes'] / 2**20:.1f} MiB" in prose


def test_the_health_transcript_is_what_health_prints(run_dir: Path) -> None:
    """Each `$ ` line runs; its output is the lines under it, with the directory replaced."""
    transcript = example("operations.md", "$ tidalpool --socket-dir").replace(RUN_DIR, str(run_dir))
    runs = re.findall(r"^\$ (.*)\n((?:[^$].*\n)*)", transcript, re.M)
    assert [line.split()[-1] for line, _ in runs] == ["health", "health"]
    codes = []
    for line, shown in runs:
        out = tidalpool(*command(line, run_dir))
        assert out.stdout + out.stderr == shown
        codes.append(out.returncode)
    assert codes == [0, 1]  # serving; no daemon in gpu1


def test_top_runs_until_ctrl_c(run_dir: Path) -> None:
    (line,) = example("operations.md", "top --interval 2").splitlines()
    with subprocess.Popen(
        [sys.executable, "-m", "tidalpool", *command(line, run_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as top:
        assert top.stdout is not None
        first = top.stdout.readline()  # waits for the first frame
        assert first.startswith("tidalpoold ") and "backend sim" in first, first
        top.send_signal(signal.SIGINT)
        assert top.wait(timeout=30) == 0, top.stderr.read() if top.stderr else ""


def test_the_promtool_checks_pass() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian's prometheus package has it)")
    block = example("metrics.md", "promtool check rules")
    out = subprocess.run(
        ["bash", "-e", "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") >= 4, out.stdout  # rules, config (+ its rules), tests


def test_the_native_fragment_names_what_exists() -> None:
    """Its import runs, and each call it makes on the HotPath is one."""
    from tidalclient.hotpath import HotPath

    fragment = [b for lang, b in fences("native.md") if lang == "python"]
    assert len(fragment) == 1 and fragment[0].startswith(FRAGMENT)
    (imports,) = [line for line in fragment[0].splitlines() if line.startswith("from ")]
    exec(imports, {})
    calls = set(re.findall(r"\bhp\.(\w+)\(", fragment[0]))
    assert calls == {"configure", "step", "drain", "install_plan", "reset"}
    assert all(callable(getattr(HotPath, name, None)) for name in calls)
