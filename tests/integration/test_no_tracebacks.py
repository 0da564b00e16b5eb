"""The commands of the README and docs/ given bad input, as a newcomer gives it, in real
processes: every error is one line on stderr with a non-zero exit status (2 for a usage error,
argparse's own included), never a traceback; `--debug` or TIDALPOOL_DEBUG=1 shows the traceback;
defaults work on small pools; and a piped table is never cut."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tidalpool
from tidalclient.local import LocalDaemon, is_serving
from tidalcore.cuda_driver import CudaError
from tidalpoold.backends.cuda import CudaBackendError, open_gpu

from .test_replay import training_trace

MiB = 1 << 20
TRACEBACK = "Traceback (most recent call last)"


def run(
    program: str, *argv: str, env: dict[str, str] | None = None, columns: int = 80
) -> subprocess.CompletedProcess[str]:
    """`program argv` (tidalpool or tidalpoold) as a user runs it, output piped; no setting from
    this environment leaks in (socket directory, daemon settings, debug)."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TIDALPOOLD_") and k not in ("TIDALPOOL_SOCKET_DIR", "TIDALPOOL_DEBUG")
    }
    return subprocess.run(
        [sys.executable, "-m", program, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, "COLUMNS": str(columns), **(env or {})},
    )


def one_line_error(out: subprocess.CompletedProcess[str], status: int) -> str:
    """The one line of an error that exited with `status`; no traceback anywhere."""
    assert TRACEBACK not in out.stdout + out.stderr, out.stderr
    assert out.returncode == status, (out.returncode, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture(scope="module")
def files() -> Iterator[dict[str, str]]:
    """A trace, a file that is no trace, a path that does not exist, and a socket directory
    where no daemon runs."""
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as d:
        root = Path(d)
        (root / "notes.txt").write_text("not a trace\n")
        yield {
            "TRACE": str(training_trace(root / "net.trace.csv")),
            "NOT_A_TRACE": str(root / "notes.txt"),
            "MISSING": str(root / "missing.trace.csv"),
            "NO_DAEMON": str(root / "no-daemon"),
        }


# (program, argv with placeholders from `files`, exit status, what the one line says)
BAD_INPUT = [
    ("tidalpool", [], 2, "tidalpool: error: the following arguments are required: command"),
    ("tidalpool", ["bogus"], 2, "tidalpool: error: argument command: invalid choice: 'bogus'"),
    ("tidalpool", ["--socket-dir"], 2, "argument --socket-dir: expected one argument"),
    # plan
    ("tidalpool", ["plan", "MISSING"], 2, "tidalpool plan: MISSING: no such file"),
    ("tidalpool", ["plan", "NOT_A_TRACE"], 2, "tidalpool plan: NOT_A_TRACE: unknown format"),
    (
        "tidalpool",
        ["plan", "TRACE", "--time-limit", "soon"],
        2,
        "tidalpool plan: error: argument --time-limit: invalid float value: 'soon'"
        " (see tidalpool plan --help)",
    ),
    # simulate
    ("tidalpool", ["simulate", "MISSING"], 2, "tidalpool simulate: MISSING: no such file"),
    ("tidalpool", ["simulate", "TRACE", "--limit", "4XB"], 2, "unknown size unit 'XB' in '4XB'"),
    ("tidalpool", ["simulate", "TRACE", "--limit", "0.01"], 2, "under the op-wise bound"),
    ("tidalpool", ["simulate", "TRACE", "--bandwidth", "fast"], 2, "invalid float value: 'fast'"),
    ("tidalpool", ["simulate", "TRACE", "--policy", "nope"], 2, "unknown policy 'nope'"),
    # replay
    ("tidalpool", ["replay", "MISSING", "--limit", "0.9"], 2, "tidalpool replay: MISSING: no such"),
    ("tidalpool", ["replay", "TRACE"], 2, "the following arguments are required: --limit"),
    ("tidalpool", ["replay", "TRACE", "--limit", "4XB"], 2, "unknown size unit 'XB' in '4XB'"),
    ("tidalpool", ["replay", "TRACE", "--limit", "0.9", "--iterations", "two"], 2, "invalid int"),
    (
        "tidalpool",
        ["replay", "TRACE", "--limit", "0.9", "--socket-dir", "NO_DAEMON"],
        2,
        "tidalpool replay: no daemon answers at NO_DAEMON",
    ),
    # demo
    (
        "tidalpool",
        ["demo", "--limit", "0.01"],
        2,
        "tidalpool demo: error: --limit 0.01 is too low: the network's op fc2.forward needs 544"
        " KiB on the device at once, 48.9% of its peak of 1.1 MiB live: use 0.49 or more (at"
        " most 1) (see tidalpool demo --help)",
    ),
    ("tidalpool", ["demo", "--limit", "0.3"], 2, "--limit 0.3 is too low"),
    ("tidalpool", ["demo", "--limit", "1.5"], 2, "--limit must be a fraction in (0, 1], not 1.5"),
    ("tidalpool", ["demo", "--limit", "half"], 2, "argument --limit: invalid float value: 'half'"),
    ("tidalpool", ["demo", "--iterations", "0"], 2, "--iterations must be at least 1"),
    ("tidalpool", ["demo", "--copy-gbps", "0"], 2, "--copy-gbps must be a positive number"),
    (
        "tidalpool",
        ["demo", "--socket-dir", "NO_DAEMON"],
        2,
        "tidalpool demo: error: unrecognized arguments: --socket-dir NO_DAEMON; --socket-dir goes"
        " before the command: tidalpool --socket-dir ... demo (see tidalpool demo --help)",
    ),
    # status, top, health
    (
        "tidalpool",
        ["--socket-dir", "NO_DAEMON", "status"],
        1,
        "tidalpool: no daemon answers at NO_DAEMON: NO_DAEMON/admin.sock does not exist",
    ),
    ("tidalpool", ["--socket-dir", "NO_DAEMON", "top", "--once"], 1, "no daemon answers at"),
    ("tidalpool", ["top", "--interval", "soon"], 2, "argument --interval: invalid float value"),
    ("tidalpool", ["top", "--interval", "0"], 2, "--interval must be a positive number"),
    ("tidalpool", ["--socket-dir", "NO_DAEMON", "health"], 1, "tidalpool: no daemon at NO_DAEMON"),
    ("tidalpool", ["health", "--timeout", "0"], 2, "--timeout must be a positive number"),
    ("tidalpool", ["quota", "s-0"], 2, "give --min, --max or both"),
    ("tidalpool", ["quota", "s-0", "--min", "lots"], 2, "tidalpool quota: error: "),
    ("tidalpool", ["quota", "s-0", "--max", "0"], 2, "--min and --max must be positive sizes"),
    ("tidalpool", ["--socket-dir", "NO_DAEMON", "quota", "s-0", "--max", "1GiB"], 1, "no daemon"),
    # tidalpoold
    ("tidalpoold", [], 2, "tidalpoold: error: the following arguments are required: command"),
    ("tidalpoold", ["serve", "--device-pool"], 2, "argument --device-pool: expected one argument"),
    ("tidalpoold", ["serve", "--device-pool", "4XB"], 2, "unknown size unit 'XB' in '4XB'"),
    ("tidalpoold", ["serve", "--config", "MISSING"], 2, "config: config file does not exist"),
    (
        "tidalpoold",
        ["serve", "--device-pool", "512MiB", "--default-device-lease", "1GiB"],
        2,
        "tidalpoold: default_device_lease: default_device_lease must not exceed device_pool (got"
        " '1GiB' from --default-device-lease); device_pool is '512MiB' from --device-pool",
    ),
]


def placed(files: dict[str, str], text: str) -> str:
    """`text` with the names of `files` (TRACE, MISSING, ...) replaced by their paths."""
    return re.sub("|".join(files), lambda m: files[m[0]], text)


@pytest.mark.parametrize(
    ("program", "argv", "status", "says"),
    BAD_INPUT,
    ids=[" ".join([program, *argv]) for program, argv, _, _ in BAD_INPUT],
)
def test_bad_input_is_one_line_and_a_non_zero_status(
    files: dict[str, str], program: str, argv: list[str], status: int, says: str
) -> None:
    line = one_line_error(run(program, *(placed(files, a) for a in argv)), status)
    assert placed(files, says) in line


def _commands(program: str) -> list[str]:
    """The commands `program --help` lists (so that one added later is tried too)."""
    out = run(program, "--help", columns=200)
    assert out.returncode == 0, out.stderr
    found = re.search(r"\{([a-z,]+)\}", out.stdout)
    assert found is not None, out.stdout
    return found[1].split(",")


# What each command needs before an option can be unknown rather than a required one missing.
REQUIRED = {
    "plan": ["TRACE"],
    "simulate": ["TRACE"],
    "replay": ["TRACE", "--limit", "0.9"],
    "quota": ["s-0"],
}
DOCUMENTED = {
    "tidalpool": {"plan", "simulate", "replay", "demo", "status", "top", "health", "quota"},
    "tidalpoold": {"serve"},
}


@pytest.mark.parametrize("program", ["tidalpool", "tidalpoold"])
def test_every_command_has_bad_input_and_refuses_an_unknown_option_in_one_line(
    files: dict[str, str], program: str
) -> None:
    commands = _commands(program)
    assert DOCUMENTED[program] <= set(commands)
    tried = {word for p, argv, _, _ in BAD_INPUT if p == program for word in argv}
    for name in commands:
        assert name in tried, f"BAD_INPUT has no case of {program} {name}"
        needed = [placed(files, a) for a in REQUIRED.get(name, [])]
        line = one_line_error(run(program, name, *needed, "--no-such-option"), 2)
        if name in DOCUMENTED[program]:
            assert line == (
                f"{program} {name}: error: unrecognized arguments: --no-such-option"
                f" (see {program} {name} --help)"
            )
        else:  # a command this test does not know yet: it may need arguments first
            assert line.startswith(f"{program} {name}: error: "), line


# -- what used to end in a traceback ---------------------------------------------------------------


def test_demo_throttled_without_a_limit_runs_and_its_piped_table_is_not_cut() -> None:
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as none:
        out = run("tidalpool", "--socket-dir", none, "demo", "--copy-gbps", "12", columns=60)
    assert (out.returncode, out.stderr) == (0, "")
    lines = out.stdout.splitlines()
    assert all(len(line) <= 60 for line in lines), [x for x in lines if len(x) > 60]
    assert "…" not in out.stdout
    # Every header and every loss whole (a 60-column table stacks its columns, and folds
    # its headers at spaces). A swapping run's columns: what each iteration moved.
    words = {w for line in lines if not re.match(r" *\d", line) for w in line.split()}
    for header in ("iter", "loss", "mode", "device", "out", "in", "stall", "trace"):
        assert set(header.split()) <= words, header
    assert len(re.findall(r"^ +\d+ +\d\.\d{6} ", out.stdout, re.M)) == 20
    text = " ".join(out.stdout.split())
    assert "copies at 12 GB/s, no --limit: swapping only when the lease is full" in text
    assert "losses bit-identical to plain NumPy over 20 iterations" in text


def test_demo_runs_at_the_lowest_limit_its_refusal_names() -> None:
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as none:
        # Five iterations: the demo waits for a plan only in longer runs.
        args = ("--socket-dir", none, "demo", "--limit", "0.49", "--iterations", "5")
        out = run("tidalpool", *args, columns=250)
    assert (out.returncode, out.stderr) == (0, "")
    assert "swapping under 544.9 KiB (0.49 of the peak 1.1 MiB)" in out.stdout
    assert "losses bit-identical to plain NumPy over 5 iterations" in out.stdout


@pytest.fixture
def small_daemon() -> Iterator[LocalDaemon]:
    """A daemon of one 2 MiB chunk per pool: too small for the demo's lease."""
    directory = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    try:
        with LocalDaemon.start(
            directory, device_pool="2MiB", host_pool="2MiB", default_lease="2MiB", chunk_size="2MiB"
        ) as daemon:
            yield daemon
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def directory() -> Iterator[Path]:
    """A short socket directory (a Unix socket path is at most 107 bytes), removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_refused_session_is_one_line_and_debug_shows_the_traceback(
    small_daemon: LocalDaemon,
) -> None:
    argv = ("--socket-dir", str(small_daemon.socket_dir), "demo")
    line = one_line_error(run("tidalpool", *argv), 1)
    assert line == (
        "tidalpool demo: tidalpoold refused the session (RESOURCE_EXHAUSTED): device pool cannot"
        " lease 2 chunks (4 MiB) for 3145728 bytes: 1 of 1 chunks of 2 MiB free"
    )
    for shown in (
        run("tidalpool", "--debug", *argv),
        run("tidalpool", *argv, "--debug"),
        run("tidalpool", *argv, env={"TIDALPOOL_DEBUG": "1"}),
    ):
        assert shown.returncode == 1
        assert TRACEBACK in shown.stderr
        assert shown.stderr.splitlines()[-1].startswith("tidalclient.errors.AttachError: ")


def serve(directory: Path, *argv: str, debug: bool = False) -> subprocess.Popen[str]:
    """`tidalpoold serve` in `directory` with no metrics endpoint, output piped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDALPOOLD_")}
    env.pop("TIDALPOOL_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "tidalpoold", *(["--debug"] if debug else []), "serve",
         "--socket-dir", str(directory), "--plan-cache-dir", str(directory / "plans"),
         "--metrics-address", "", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )  # fmt: skip


def serving_or_exited(process: subprocess.Popen[str], directory: Path) -> bool:
    """Wait until the daemon serves (True) or has exited (False)."""
    deadline = time.monotonic() + 60
    while process.poll() is None:
        if is_serving(directory, timeout=0.5):
            return True
        assert time.monotonic() < deadline, "tidalpoold neither served nor exited in 60 s"
        time.sleep(0.05)
    return False


def stop(process: subprocess.Popen[str]) -> tuple[int, str]:
    """SIGTERM; the exit status and stderr."""
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    return process.returncode, err


def test_small_pools_start_with_their_default_leases(directory: Path) -> None:
    daemon = serve(directory, "--device-pool", "512MiB", "--host-pool", "1GiB")
    try:
        assert serving_or_exited(daemon, directory), daemon.communicate(timeout=60)[1]
        with tidalpool.attach(directory) as session:  # asks for no size: the default leases
            assert (session.device.length, session.host.length) == (512 * MiB, 1024 * MiB)
    finally:
        status, err = stop(daemon)
    assert status == 0, err
    assert TRACEBACK not in err


def test_the_cuda_backend_starts_or_says_why_in_one_line(directory: Path) -> None:
    """Without a GPU (or its driver) one line names the sim backend; on a GPU it serves."""
    pools = ["--backend", "cuda", "--device-pool", "64MiB", "--host-pool", "64MiB"]
    pools += ["--default-device-lease", "2MiB", "--default-host-lease", "2MiB"]
    daemon = serve(directory, *pools, "--chunk-size", "2MiB")
    if serving_or_exited(daemon, directory):
        status, err = stop(daemon)
        assert status == 0 and TRACEBACK not in err, err
        return
    out, err = daemon.communicate(timeout=60)
    assert TRACEBACK not in out + err, err
    assert daemon.returncode == 1
    assert len(err.splitlines()) == 1, err
    assert err.startswith("tidalpoold: cannot start: "), err
    assert err.endswith(": without a GPU, use --backend sim\n"), err
    shown = serve(directory, *pools, "--chunk-size", "2MiB", debug=True)
    _, err = shown.communicate(timeout=60)
    assert shown.returncode == 1 and TRACEBACK in err
    assert "tidalpoold.backends.cuda.CudaBackendError: " in err


def test_a_start_that_fails_is_one_line_and_debug_shows_the_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as d:
            pools = ["--device-pool", "8MiB", "--host-pool", "8MiB", "--chunk-size", "2MiB"]
            pools += ["--default-device-lease", "2MiB", "--default-host-lease", "2MiB"]
            argv = ("serve", "--socket-dir", d, "--plan-cache-dir", d, *pools)
            line = one_line_error(run("tidalpoold", *argv, "--metrics-address", address), 1)
            shown = run("tidalpoold", *argv, "--metrics-address", address, "--debug")
    assert line == (
        f"tidalpoold: cannot start: cannot serve metrics on metrics_address '{address}': Address"
        ' already in use (choose another with --metrics-address HOST:PORT, or "" for none)'
    )
    assert shown.returncode == 1 and TRACEBACK in shown.stderr


class _NoDriver:
    """A driver whose library cannot be loaded, as cuda-bindings fails without libcuda."""

    def open_device(self, ordinal: int) -> None:
        raise RuntimeError(
            '"cuda" is an NVIDIA driver library and can only be found via system search.\n'
            "Ensure the NVIDIA display driver is installed."
        )


class _NoDevice:
    def open_device(self, ordinal: int) -> None:
        raise CudaError("cuInit", 100, "CUDA_ERROR_NO_DEVICE")


def test_a_gpu_that_cannot_be_opened_is_a_backend_error_of_one_line() -> None:
    with pytest.raises(CudaBackendError) as info:
        open_gpu(_NoDriver(), 0)  # type: ignore[arg-type]
    assert str(info.value) == (
        'the CUDA driver library cannot be loaded ("cuda" is an NVIDIA driver library and can'
        " only be found via system search. Ensure the NVIDIA display driver is installed.):"
        " without a GPU, use --backend sim"
    )
    with pytest.raises(CudaBackendError) as info:
        open_gpu(_NoDevice(), 1)  # type: ignore[arg-type]
    assert str(info.value) == (
        "cannot open GPU 1 (cuInit failed: CUDA_ERROR_NO_DEVICE (100)): without a GPU, use"
        " --backend sim"
    )


def test_the_replay_report_piped_fits_its_width(files: dict[str, str]) -> None:
    argv = ("replay", files["TRACE"], "--limit", "0.9", "--copy-gbps", "4", "--iterations", "5")
    out = run("tidalpool", *argv, columns=60)
    assert out.returncode == 0, out.stderr
    assert TRACEBACK not in out.stderr
    lines = out.stdout.splitlines()
    assert all(len(line) <= 60 for line in lines), [x for x in lines if len(x) > 60]
    assert "…" not in out.stdout
    for header in ("phase", "out on demand", "mismatches", "measured / predicted"):
        assert any(header in line for line in lines), header
    assert len(re.findall(r"│ +\d+\.\d\d ms │", out.stdout)) >= 2 * 5  # step and stall, whole
