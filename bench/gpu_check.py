"""Every GPU figure of the project in one call (`make gpu-check`; docs/benchmarks.md, "GPU check").

    python3 bench/gpu_check.py [--dry-run | --force] [--budget 480] [--only A,B] [--skip A,B]
        [--wheels .gpu-wheels] [--out PATH] [--copy-to DIR] [--note TEXT]

Made for a lent GPU machine (H100 or H200, with PyTorch, CuPy and cuda-bindings, no network):
installs the package from the wheels carried in .gpu-wheels/, then runs the parts below in
order, each in a process group of its own under its own time limit, all of them within
--budget seconds (the install included). A part past its limit is stopped (SIGTERM, then
SIGKILL, the whole group: its daemons too) and costs only that limit; a part the budget has no
time left for is skipped, and says so; a part whose `needs` failed is skipped, and says which.

    install            pip install --no-index --find-links .gpu-wheels -e .
    imports            the versions of what the parts use; the rest need the package
    tests-gpu          pytest tests/gpu
    conformance-cuda   the conformance suite's cuda cases
    gpu-vmm            bench/gpu_vmm.py: cuMemMap / cuMemUnmap of lease pages
    gpu-bench          bench/gpu.py: copies, and training at 0.9, 0.75 and 0.5 of the peak with
                       the daemon's predicted step beside the measured one
    gpu-bench-paged    the same training with the limit sessions paged in 2 MiB pages
    replay-*           tidalpool replay --backend cuda --compute-scale 50: ResNet-18 at 0.9 and
                       0.7 of its peak (contiguous) and at 0.7 in 2 MiB pages, GPT-2 at 0.9 in
                       2 MiB pages, each with its timeline (in the logs' archive)
    torch-train-*      bench/torch_train.py throughput and limit rows, fp32 and bf16

One JSON holds, per part: status (passed, failed, timed out, skipped), the reason, wall
seconds, the part's own JSON where it writes one (also when it failed or was stopped), and the
tail of its log; it is written after every part, to --out (default
bench/results/gpu-check-<date>-<device>.json) and into --copy-to, where the logs go too as
gpu-check-logs.tar.gz. A table is printed at the end.

Without a GPU (or with --dry-run) nothing runs: every part is listed as skipped with the reason,
the files the parts name are checked, and the JSON goes to build/gpu-check/ (not committed)
unless --out says otherwise; the exit status is 1 only if a named file is missing. With a GPU it
is 1 if any part failed or was stopped. Standard library only: it runs before the package is
installed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEEL_LIST = ROOT / "bench" / "gpu-wheels.txt"
BUDGET_S = 480.0  # 8 minutes: a lent machine's session has 15, its start takes 1 to 2
MIN_SLOT_S = 10.0  # a part is not started with less of the budget left
GRACE_S = 5.0  # from SIGTERM to SIGKILL of a stopped part's process group
TAIL_CHARS = 3000
# Replays (trace, limit, page or None: a contiguous lease) that plan on sim, their ops 50 times
# their traced time: at 1 the host's per-op work (about 40 ms an iteration for ResNet-18 on the
# H200 of 2026-11-28) outlasts the GPU's 2 ms and the step measures the host. MLP is left out:
# no plan fits it under 0.99 of its peak (every block is live at its op 24).
REPLAYS = (
    ("resnet18.b8", "0.9", None),
    ("resnet18.b8", "0.7", None),
    ("resnet18.b8", "0.7", "2MiB"),
    ("gpt2.b4.s128", "0.9", "2MiB"),
)
REPLAY_SCALE = 50
TORCH_MODELS = ("gpt2", "resnet50")
PASSED, FAILED, TIMED_OUT, SKIPPED = "passed", "failed", "timed out", "skipped"

# What `imports` prints: the versions of everything the parts use, one JSON object. It fails
# (and the parts after it are skipped) only when the package itself cannot be imported; what
# else is missing it names, and the parts that need it fail on their own.
IMPORTS = """
import importlib, json, sys
found = {"python": sys.version.split()[0], "executable": sys.executable}
for name in ("tidalpool", "tidalpoold", "tidalcore.v1.pool_pb2_grpc", "tidalplan._exact",
             "grpc", "google.protobuf", "numpy", "torch", "cupy", "cuda.bindings", "pynvml",
             "optuna", "highspy", "pytest", "pytest_timeout"):
    try:
        module = importlib.import_module(name)
    except Exception as e:
        found[name] = "missing: " + str(e)
    else:
        found[name] = str(getattr(module, "__version__", "ok"))
if "torch" in sys.modules:
    import torch
    found["torch.version.cuda"] = torch.version.cuda
    found["torch.cuda.is_available"] = torch.cuda.is_available()
print(json.dumps(found))
missing = [name for name, v in found.items() if str(v).startswith("missing")]
if missing:
    print("missing: " + ", ".join(missing), file=sys.stderr)
sys.exit(any(name.startswith("tidal") for name in missing))  # the package: the rest need it
"""


@dataclass(frozen=True)
class Part:
    """One step of the check: `command`, run from the repository root."""

    name: str
    what: str
    command: tuple[str, ...]
    limit_s: float
    output: str = ""  # its own results: a .json or .xml (junit) file it writes, "-" for stdout
    needs: tuple[str, ...] = ()  # parts that must have passed (when they were run at all)
    files: tuple[str, ...] = ()  # repository files it runs or reads, checked by a dry run


@dataclass
class Outcome:
    """What became of one part."""

    name: str
    what: str
    command: list[str]
    limit_s: float
    status: str
    reason: str = ""
    wall_s: float = 0.0
    returncode: int | None = None
    result: Any = None
    log: str = ""
    log_tail: str = ""
    gpu_used_mib_after: int | None = None


@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str
    memory_mib: int

    @property
    def slug(self) -> str:
        return device_slug(self.name)


def device_slug(name: str) -> str:
    """A device name as a file name's part: 'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3'
    -> 'h100'."""
    words = [w for w in name.lower().split() if w != "nvidia"]
    return re.sub(r"[^a-z0-9]+", "", words[0]) if words else "gpu"


# -- the parts (pure) -------------------------------------------------------------------------


def argv(line: str, **values: str) -> tuple[str, ...]:
    """The words of a command line (shlex), {names} in each filled in from `values`."""
    return tuple(word.format(**values) for word in shlex.split(line))


def parts(python: str, work: Path, wheels: Path) -> list[Part]:
    """Every part, in the order they run; their own output files go under `work`."""
    v = {"python": python, "work": str(work), "wheels": str(wheels), "root": str(ROOT)}
    pytest = "{python} -m pytest -q -rfEs --tb=line -p no:cacheprovider"
    found: list[Part] = [
        Part(
            "install",
            f"the package and the wheels of {wheels.name}/, offline",
            argv(
                "{python} -m pip install --disable-pip-version-check --no-input --no-index"
                " --find-links {wheels} -e {root}",
                **v,
            ),
            180,
            files=("pyproject.toml",),
        ),
        Part(
            "imports",
            "the versions of what the parts use",
            (python, "-c", IMPORTS),
            60,
            output="-",
            needs=("install",),
        ),
        Part(
            "tests-gpu",
            "pytest tests/gpu",
            argv(f"{pytest} --timeout 90 --junitxml {{work}}/tests-gpu.xml tests/gpu", **v),
            240,
            output="tests-gpu.xml",
            needs=("imports",),
            files=("tests/gpu",),
        ),
        Part(
            "conformance-cuda",
            "the conformance suite's cuda cases",
            argv(
                f"{pytest} --timeout 60 --junitxml {{work}}/conformance-cuda.xml"
                " -k 'cuda and not sim' tests/conformance",
                **v,
            ),
            120,
            output="conformance-cuda.xml",
            needs=("imports",),
            files=("tests/conformance",),
        ),
        Part(
            "gpu-vmm",
            "cuMemMap / cuMemUnmap of lease pages (bench/gpu_vmm.py)",
            argv("{python} bench/gpu_vmm.py --out {work}/gpu-vmm.json", **v),
            60,
            output="gpu-vmm.json",
            needs=("imports",),
            files=("bench/gpu_vmm.py",),
        ),
        Part(
            "gpu-bench",
            "copies; training at 0.9/0.75/0.5 of the peak, measured and predicted (bench/gpu.py)",
            argv(
                "{python} bench/gpu.py --skip attach --limits 0.9,0.75,0.5 --rounds 2"
                " --iterations 20 --json {work}/gpu-bench.json",
                **v,
            ),
            120,
            output="gpu-bench.json",
            needs=("imports",),
            files=("bench/gpu.py",),
        ),
        Part(
            "gpu-bench-paged",
            "training at 0.9/0.75/0.5 in 2 MiB pages (virtual residency), measured and predicted",
            argv(
                "{python} bench/gpu.py --skip copy,attach --limits 0.9,0.75,0.5 --rounds 2"
                " --iterations 20 --page 2MiB --json {work}/gpu-bench-paged.json",
                **v,
            ),
            120,
            output="gpu-bench-paged.json",
            needs=("imports",),
            files=("bench/gpu.py",),
        ),
    ]
    for trace, limit, page in REPLAYS:
        path = f"traces/{trace}.trace.csv"
        name = f"{trace}-{limit}" + ("-paged" if page else "")
        paging = f" --page {page}" if page else ""
        found.append(
            Part(
                f"replay-{name}",
                f"tidalpool replay {path} --limit {limit}{paging} --backend cuda",
                argv(
                    f"{{python}} -m tidalpool replay {path} --limit {limit}{paging}"
                    f" --backend cuda --compute-scale {REPLAY_SCALE} --plan-timeout 30"
                    f" --timeline {{work}}/timeline-{name}.json --json",
                    **v,
                ),
                50,
                output="-",
                needs=("imports",),
                files=(path,),
            )
        )
    for model in TORCH_MODELS:
        found.append(
            Part(
                f"torch-train-{model}",
                f"bench/torch_train.py {model}, fp32 and bf16: throughput and limit rows",
                argv(
                    f"{{python}} bench/torch_train.py --models {model} --dtypes fp32,bf16"
                    " --skip batch,latency --steps 10 --host-pool 16GiB"
                    f" --json {{work}}/torch-train-{model}.json",
                    **v,
                ),
                150,
                output=f"torch-train-{model}.json",
                needs=("imports",),
                files=("bench/torch_train.py",),
            )
        )
    return found


def shown(command: Sequence[str]) -> str:
    """A command as a shell would take it (a script given with -c as '<script>')."""
    return " ".join("'<script>'" if "\n" in w else shlex.quote(w) for w in command)


def select(found: Sequence[Part], only: Sequence[str], skip: Sequence[str]) -> list[Part]:
    """The parts named by `only` (all when empty; a name ending in * is a prefix), less those
    named by `skip`. SystemExit names a name that matches no part."""

    def matches(name: str, pattern: str) -> bool:
        return name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern

    for pattern in (*only, *skip):
        if not any(matches(p.name, pattern) for p in found):
            names = ", ".join(p.name for p in found)
            raise SystemExit(f"gpu_check: no part is named {pattern!r} (parts: {names})")
    return [
        p
        for p in found
        if (not only or any(matches(p.name, o) for o in only))
        and not any(matches(p.name, s) for s in skip)
    ]


def missing_files(found: Sequence[Part]) -> list[str]:
    """The repository files the parts name that are not there."""
    return sorted({f for p in found for f in p.files if not (ROOT / f).exists()})


def wheel_requirements() -> list[str]:
    """The pinned requirements of bench/gpu-wheels.txt."""
    lines = (line.split("#")[0].strip() for line in WHEEL_LIST.read_text().splitlines())
    return [line for line in lines if line]


def wheels_missing(wheels: Path) -> list[str]:
    """The requirements of bench/gpu-wheels.txt with no wheel of that version in `wheels`."""
    have = set()
    if wheels.is_dir():
        for wheel in wheels.glob("*.whl"):
            project, version = wheel.name.split("-")[:2]
            have.add(pinned(project, version))
    return [r for r in wheel_requirements() if pinned(*r.split("==")) not in have]


def pinned(project: str, version: str) -> str:
    """`project==version` with the project's name normalized as wheel file names have it."""
    return re.sub(r"[-_.]+", "_", project).lower() + "==" + version


# -- running ----------------------------------------------------------------------------------


def run_part(part: Part, work: Path, limit_s: float, env: dict[str, str]) -> Outcome:
    """Run `part` in a process group of its own for at most `limit_s` seconds; stop the whole
    group past it (SIGTERM, then SIGKILL after GRACE_S), and kill whatever of the group outlives
    its leader either way (a daemon left behind would hold the GPU's memory)."""
    log_path = work / f"{part.name}.log"
    stdout_path = work / f"{part.name}.stdout" if part.output == "-" else None
    outcome = Outcome(part.name, part.what, list(part.command), limit_s, FAILED, log=log_path.name)
    started = time.monotonic()
    with open(log_path, "wb") as log, open(stdout_path or os.devnull, "wb") as stdout:
        try:
            proc = subprocess.Popen(
                part.command,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=stdout if stdout_path else log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        except OSError as e:
            outcome.reason = f"could not start: {e}"
            return outcome
        try:
            outcome.returncode = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
            outcome.status, outcome.reason = TIMED_OUT, f"stopped at its limit of {limit_s:g} s"
        finally:
            _signal_group(proc.pid, signal.SIGKILL)
    outcome.wall_s = round(time.monotonic() - started, 2)
    outcome.log_tail = tail(log_path)
    outcome.result = read_result(part, work, stdout_path)
    if outcome.status != TIMED_OUT:
        if outcome.returncode == 0:
            outcome.status = PASSED
        else:
            last = outcome.log_tail.strip().splitlines()[-1:] or [""]
            outcome.reason = f"exit status {outcome.returncode}: {last[0][:300]}".rstrip(": ")
    return outcome


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(pgid, sig)


def tail(path: Path, chars: int = TAIL_CHARS) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - chars))
        return f.read().decode(errors="replace")


def read_result(part: Part, work: Path, stdout_path: Path | None) -> Any:
    """The part's own results, parsed (None where it wrote none, or nothing readable)."""
    path = stdout_path if part.output == "-" else work / part.output if part.output else None
    if path is None or not path.exists():
        return None
    try:
        if path.suffix == ".xml":
            return junit_summary(path)
        text = path.read_text()
        return json.loads(text) if part.output != "-" else last_json(text)
    except (ValueError, ET.ParseError) as e:
        return {"unreadable": f"{path.name}: {e}"}


def last_json(text: str) -> Any:
    """The JSON object a command printed last: the whole text, or else its last line."""
    try:
        return json.loads(text)
    except ValueError:
        lines = text.strip().splitlines()
        return json.loads(lines[-1]) if lines else None


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts of a pytest junit XML, with each failure's and skip's test and first line."""
    counts = {PASSED: 0, FAILED: 0, "errors": 0, SKIPPED: 0}
    failures, skips = [], []
    for case in ET.parse(path).iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            counts[FAILED if bad.tag == "failure" else "errors"] += 1
            failures.append({"test": test, "message": first_line(bad.get("message", ""))})
        elif skipped is not None:
            counts[SKIPPED] += 1
            skips.append({"test": test, "reason": first_line(skipped.get("message", ""))})
        else:
            counts[PASSED] += 1
    return {**counts, "failures": failures, "skips": skips}


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


Runner = Callable[[Part, Path, float, dict[str, str]], Outcome]


def run_all(
    found: Sequence[Part],
    work: Path,
    budget_s: float,
    env: dict[str, str],
    runner: Runner = run_part,
    after_each: Callable[[list[Outcome]], None] = lambda outcomes: None,
    clock: Callable[[], float] = time.monotonic,
) -> list[Outcome]:
    """Run the parts in order within `budget_s` seconds: each under the smaller of its limit
    and what the budget has left, none started with less than MIN_SLOT_S left, none whose
    needs (among the parts run) did not pass. `after_each` sees the outcomes so far."""
    start = clock()
    outcomes: list[Outcome] = []
    by_name: dict[str, Outcome] = {}
    for part in found:
        left = budget_s - (clock() - start)
        unmet = [by_name[n] for n in part.needs if n in by_name and by_name[n].status != PASSED]
        if unmet:
            why = f"needs {unmet[0].name}, which {unmet[0].status}"
            outcome = skipped(part, why)
        elif left < MIN_SLOT_S:
            outcome = skipped(part, f"the budget of {budget_s:g} s was spent ({left:.0f} s left)")
        else:
            outcome = runner(part, work, min(part.limit_s, round(left, 1)), env)
            outcome.gpu_used_mib_after = gpu_used_mib()
        outcomes.append(outcome)
        by_name[part.name] = outcome
        after_each(outcomes)
    return outcomes


def skipped(part: Part, why: str) -> Outcome:
    return Outcome(part.name, part.what, list(part.command), part.limit_s, SKIPPED, why)


# -- the device -------------------------------------------------------------------------------


def nvidia_smi(*query: str) -> str | None:
    """nvidia-smi's answer about GPU 0 (CSV, no header, no units), or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "--id=0", *query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def find_gpu() -> Gpu | str:
    """GPU 0, or why there is none to check."""
    if not Path("/dev/nvidiactl").exists():
        return "no NVIDIA GPU on this machine (/dev/nvidiactl is absent)"
    answer = nvidia_smi("--query-gpu=name,driver_version,memory.total")
    if answer is None:
        return "nvidia-smi is missing or reports no GPU"
    name, driver, memory = (x.strip() for x in answer.splitlines()[0].split(","))
    return Gpu(name, driver, int(float(memory)))


def gpu_used_mib() -> int | None:
    answer = nvidia_smi("--query-gpu=memory.used")
    try:
        return int(float(answer.splitlines()[0])) if answer else None
    except ValueError:
        return None


# -- the report -------------------------------------------------------------------------------


def counts(outcomes: Sequence[Outcome]) -> dict[str, int]:
    return {s: sum(o.status == s for o in outcomes) for s in (PASSED, FAILED, TIMED_OUT, SKIPPED)}


def report(
    outcomes: Sequence[Outcome],
    gpu: Gpu | None,
    dry_run: str,
    budget_s: float,
    wall_s: float,
    note: str,
    plumbing: dict[str, Any],
) -> dict[str, Any]:
    """The JSON of the whole check."""
    return {
        "check": "gpu-check",
        "date": datetime.date.today().isoformat(),
        "device": None if gpu is None else {**asdict(gpu), "slug": gpu.slug},
        "dry_run": dry_run or None,
        "note": note or None,
        "python": sys.executable,
        "budget_s": budget_s,
        "wall_s": round(wall_s, 1),
        "counts": counts(outcomes),
        "plumbing": plumbing,
        "parts": [asdict(o) for o in outcomes],
    }


def note_of(o: Outcome) -> str:
    """One line for the table: what the part's results say in short, or the reason."""
    r = o.result if isinstance(o.result, dict) else {}
    if "failures" in r:  # pytest
        said = ", ".join(f"{r[k]} {k}" for k in (PASSED, FAILED, "errors", SKIPPED) if r[k])
        return said + (f"; {o.reason}" if o.status == TIMED_OUT else "")
    if "executable" in r:  # imports
        missing = [name for name, v in r.items() if str(v).startswith("missing")]
        if missing:
            return "missing: " + ", ".join(missing)
        return f"Python {r['python']}, torch {r.get('torch')}, CuPy {r.get('cupy')}"
    if "outcome" in r:  # tidalpool replay
        measured, predicted = r.get("measured") or {}, r.get("predicted") or {}
        if r["outcome"] == "compared" and "step_ns" in measured and "step_ns" in predicted:
            ms, pms = measured["step_ns"] / 1e6, predicted["step_ns"] / 1e6
            return f"step {ms:.2f} ms, predicted {pms:.2f} ms"
        return str(r["outcome"])[:90]
    return o.reason[:90]


def table(outcomes: Sequence[Outcome], dry_run: bool = False) -> str:
    """One row a part; in a dry run the note says what the part runs (the reason is the same
    for all, printed once)."""
    rows = [("part", "status", "wall s", "limit s", "what" if dry_run else "note")]
    for o in outcomes:
        rows.append(
            (
                o.name,
                o.status,
                f"{o.wall_s:.1f}",
                f"{o.limit_s:g}",
                o.what if dry_run else note_of(o),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        cells = [row[i].rjust(w) if i == 2 else row[i].ljust(w) for i, w in enumerate(widths)]
        lines.append("  ".join([*cells, row[4]]).rstrip())
    return "\n".join(lines)


def write(data: dict[str, Any], out: Path, copy_to: Path | None) -> None:
    """`data` to `out`, and to a file of the same name in `copy_to`."""
    text = json.dumps(data, indent=2) + "\n"
    for path in (out, *(() if copy_to is None else (copy_to / out.name,))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def pack_logs(work: Path, copy_to: Path) -> None:
    """The logs and the parts' own files of `work`, as gpu-check-logs.tar.gz in `copy_to`."""
    with tarfile.open(copy_to / "gpu-check-logs.tar.gz", "w:gz") as tar:
        for path in sorted(work.iterdir()):
            tar.add(path, arcname=f"gpu-check/{path.name}")


# -- the command ------------------------------------------------------------------------------


def arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dry-run", action="store_true", help="list the parts, run none")
    ap.add_argument("--force", action="store_true", help="run the parts even without a GPU")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all the parts")
    ap.add_argument("--only", default="", help="comma-separated part names (a trailing * matches)")
    ap.add_argument("--skip", default="", help="comma-separated part names not to run")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".gpu-wheels")
    ap.add_argument("--out", type=Path, help="the JSON (default: see above)")
    ap.add_argument("--copy-to", type=Path, help="also write the JSON and the logs here ($OUT)")
    ap.add_argument("--note", default="", help="recorded as it is (the commit, say)")
    ap.add_argument("--list", action="store_true", help="print the parts' commands and exit")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = arguments(argv)
    date = datetime.date.today().isoformat()
    found = find_gpu()
    gpu = found if isinstance(found, Gpu) else None
    dry_run = "asked for (--dry-run)" if a.dry_run else ""
    if gpu is None and not a.dry_run and not a.force:
        dry_run = f"no GPU to check: {found}"
    slug = gpu.slug if gpu is not None else "cpu"
    work = ROOT / "build" / "gpu-check" / f"{date}-{slug}"  # logs and the parts' own files
    only, skip = ([x for x in text.split(",") if x] for text in (a.only, a.skip))
    chosen = select(parts(sys.executable, work, a.wheels.resolve()), only, skip)
    if a.list:
        for p in chosen:
            print(f"{p.name} ({p.limit_s:g} s): {shown(p.command)}")
        return 0
    results = work if dry_run else ROOT / "bench" / "results"
    out = a.out or results / f"gpu-check-{date}-{slug}.json"
    plumbing = {
        "missing_files": missing_files(chosen),
        "wheels": str(a.wheels),
        "wheels_missing": wheels_missing(a.wheels),
    }
    started = time.monotonic()

    def save(outcomes: list[Outcome]) -> None:
        wall = time.monotonic() - started
        write(report(outcomes, gpu, dry_run, a.budget, wall, a.note, plumbing), out, a.copy_to)

    shutil.rmtree(work, ignore_errors=True)  # no file of an earlier run is read as this one's
    work.mkdir(parents=True)
    if dry_run:
        outcomes = [skipped(p, f"dry run: {dry_run}") for p in chosen]
        save(outcomes)
    else:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        outcomes = run_all(chosen, work, a.budget, env, after_each=save)
    if a.copy_to is not None:
        pack_logs(work, a.copy_to)

    device = "no GPU" if gpu is None else f"{gpu.name} (driver {gpu.driver})"
    said = ", ".join(f"{n} {status}" for status, n in counts(outcomes).items() if n)
    print(f"gpu-check on {device}, budget {a.budget:g} s: {said}")
    if dry_run:
        print(f"dry run: {dry_run}")
    print(table(outcomes, bool(dry_run)))
    if plumbing["missing_files"]:
        print(f"files the parts name are missing: {', '.join(plumbing['missing_files'])}")
    if plumbing["wheels_missing"]:
        print(
            f"{len(plumbing['wheels_missing'])} of the {len(wheel_requirements())} wheels of"
            f" bench/gpu-wheels.txt are missing from {a.wheels} (`make gpu-wheels` gets them)"
        )
    print(f"wrote {out}")
    if dry_run:
        return 1 if plumbing["missing_files"] else 0
    return 0 if all(o.status in (PASSED, SKIPPED) for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
