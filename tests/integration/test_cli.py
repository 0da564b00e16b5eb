"""The command lines as a user runs them: tidalpool demo, tidalpool status, tidalpoold."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tidalpool
from tidalclient.local import LocalDaemon, is_serving

from ..conftest import StartDaemon


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tidalpool", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_demo_starts_its_own_daemon_and_matches_plain_numpy() -> None:
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as missing:
        out = run_cli(
            "demo", "--iterations", "5", env={"TIDALPOOL_SOCKET_DIR": missing, "COLUMNS": "200"}
        )
    assert out.returncode == 0, out.stderr
    assert "starting a sim daemon" in out.stdout
    assert "losses bit-identical to plain NumPy over 5 iterations" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r" *\d+ +\d+\.", line)]
    assert [row[0] for row in rows] == ["0", "1", "2", "3", "4"]


def test_demo_uses_a_running_daemon(daemon: LocalDaemon) -> None:
    out = run_cli("--socket-dir", str(daemon.socket_dir), "demo", "--iterations", "2")
    assert out.returncode == 0, out.stderr
    assert f"using the daemon at {daemon.socket_dir}" in out.stdout.replace("\n", "")
    assert "session.ended" in daemon.log_path.read_text()


def test_demo_under_half_its_peak_swaps_and_matches_plain_numpy(daemon: LocalDaemon) -> None:
    out = run_cli(
        "--socket-dir",
        str(daemon.socket_dir),
        "demo",
        "--iterations",
        "4",
        "--limit",
        "0.5",
        env={"COLUMNS": "250"},
    )
    assert out.returncode == 0, out.stderr
    assert "losses bit-identical to plain NumPy over 4 iterations" in out.stdout
    # The network's peak is 1,138,768 live bytes (test_net); half of it is 569,384 bytes.
    assert "network peak 1.1 MiB live, swap limit 556 KiB (0.5)" in out.stdout
    header = next(line for line in out.stdout.splitlines() if line.startswith("iter "))
    # What each iteration moved, in one table (the lines after it give the totals).
    assert re.split(r"\s{2,}", header.strip())[-5:] == ["device", "out", "in", "stall", "trace"]
    summary = re.search(
        r"swapping under 556 KiB \(0.5 of the peak 1.1 MiB\): at most ([\d.]+) KiB on the device; "
        r"([\d.]+) MiB out in ([\d,]+) copies, ([\d.]+) MiB in in ([\d,]+); "
        r"ops waited ([\d.]+) ms for copies",
        out.stdout.replace("\n", " "),
    )
    assert summary is not None, out.stdout
    peak_kib, out_mib, _, in_mib, _, _ = summary.groups()
    assert float(peak_kib) <= 569_384 / 1024
    # The parameters alone (664 KiB) exceed the limit: every iteration swaps some of them.
    assert float(out_mib) > 1 and float(in_mib) > 1


def test_demo_at_half_its_peak_runs_the_daemons_plan_in_pages(daemon: LocalDaemon) -> None:
    # Half the peak is under the parameters alone (664 KiB): in pages of 4 KiB each keeps its
    # address, and the daemon's plan moves them between their uses; the demo waits for it after
    # its fourth iteration and runs it from the next.
    out = run_cli(
        "--socket-dir", str(daemon.socket_dir), "demo", "--iterations", "8", "--limit", "0.5"
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "swap limit 556 KiB (0.5), pages of 4 KiB" in text
    found = re.search(r"switched to the daemon's plan after (\d) iterations: footprint", text)
    assert found is not None and int(found[1]) <= 5, text
    assert "0 plan misses" in text
    assert "losses bit-identical to plain NumPy over 8 iterations" in text


def test_demo_refuses_a_limit_that_is_not_a_fraction() -> None:
    out = run_cli("demo", "--limit", "1.5")
    assert out.returncode == 2
    assert "--limit must be a fraction in (0, 1]" in out.stderr


def test_status_lists_pool_and_sessions(daemon: LocalDaemon) -> None:
    with tidalpool.attach(daemon.socket_dir, device_limit="8MiB", job_name="train-a"):
        out = run_cli("--socket-dir", str(daemon.socket_dir), "status", "--json")
        table = run_cli("--socket-dir", str(daemon.socket_dir), "status", env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["pool"]["backend"] == "sim"
    assert int(data["pool"]["device"]["leased_bytes"]) == 8 << 20
    assert [s["job_name"] for s in data["sessions"]] == ["train-a"]
    assert "train-a" in table.stdout and "8 MiB" in table.stdout


def test_status_without_a_daemon_says_so() -> None:
    out = run_cli("--socket-dir", "/tmp/tp-none-here", "status")
    assert out.returncode == 1
    assert "no daemon answers at /tmp/tp-none-here" in out.stderr


def test_daemon_json_logs_one_object_per_line(start_daemon: StartDaemon) -> None:
    d = start_daemon("--log-format", "json")
    with tidalpool.attach(d.socket_dir):
        pass
    d.stop()
    lines = [json.loads(line) for line in d.log_path.read_text().splitlines()]
    events = [line["event"] for line in lines]
    assert events[0] == "daemon.ready"
    ready = lines[0]
    assert (ready["backend"], ready["mode"], ready["chunk_bytes"]) == ("sim", "memfd", 2 << 20)
    assert (ready["device_chunks"], ready["host_chunks"]) == (128, 128)
    assert "memfd" in ready["mode_reason"]
    assert ready["open_files"]["limit"] >= ready["open_files"]["needed"]
    assert events[-1] == "daemon.stopped"
    assert {"session.opened", "session.attached", "session.ended", "daemon.stopping"} <= set(events)


def test_sigint_stops_gracefully(start_daemon: StartDaemon) -> None:
    d = start_daemon()
    d.process.send_signal(signal.SIGINT)
    assert d.process.wait(10) == 0
    assert "why=received SIGINT" in d.log_path.read_text()
    assert not (d.socket_dir / "tidalpool.sock").exists()


def test_bad_settings_exit_2_naming_the_setting() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tidalpoold", "serve", "--device-pool", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--device-pool" in out.stderr and "lots" in out.stderr


def test_a_second_daemon_on_the_same_directory_is_refused(daemon: LocalDaemon) -> None:
    started = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tidalpoold",
            "serve",
            "--socket-dir",
            str(daemon.socket_dir),
            "--device-pool",
            "64MiB",
            "--host-pool",
            "64MiB",
            "--default-device-lease",
            "8MiB",
            "--default-host-lease",
            "8MiB",
            "--metrics-address",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert f"another daemon (pid {daemon.process.pid}) serves {daemon.socket_dir}" in out.stderr
    assert time.monotonic() - started < 30
    assert is_serving(Path(daemon.socket_dir))


def serve_quickly(*args: str) -> subprocess.CompletedProcess[str]:
    """`tidalpoold serve` with small pools in a fresh directory; for starts that fail."""
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as d:
        return subprocess.run(
            [sys.executable, "-m", "tidalpoold", "serve", "--socket-dir", d, "--device-pool",
             "8MiB", "--host-pool", "8MiB", "--default-device-lease", "2MiB",
             "--default-host-lease", "2MiB", "--chunk-size", "2MiB", "--plan-cache-dir", d,
             *args],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip


def test_a_metrics_address_that_cannot_be_served_stops_the_start_naming_it() -> None:
    malformed = serve_quickly("--metrics-address", "localhost")
    assert malformed.returncode == 2
    assert "metrics_address: must be host:port" in malformed.stderr
    assert "'localhost' from --metrics-address" in malformed.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        in_use = serve_quickly("--metrics-address", address)
    assert in_use.returncode == 1
    assert f"cannot serve metrics on metrics_address '{address}': Address already in use" in (
        in_use.stderr
    )
