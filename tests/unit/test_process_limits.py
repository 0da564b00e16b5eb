"""The daemon process at start: open-files room for every chunk, and no way in through /proc."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile

PREAMBLE = (
    "import ctypes, resource\n"
    "from tidalpoold.settings import Settings\n"
    "from tidalpoold.server import ensure_fd_room, make_undumpable\n"
)


def run(code: str, nofile: tuple[int, int] | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    return subprocess.run(
        [sys.executable, "-c", PREAMBLE + code],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_the_soft_open_files_limit_is_raised_to_the_hard_one_when_the_chunks_need_it() -> None:
    out = run(
        "print(ensure_fd_room(1000, Settings()))\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n",
        nofile=(300, 4096),
    )
    assert out.returncode == 0, out.stderr
    # 1000 chunks + 256 headroom + tidalpool.sock's spare places (3 × 64) and waiting room (64)
    # + 8 per session for 64 sessions
    assert out.stdout.splitlines() == [
        "{'limit': 4096, 'raised_from': 300, 'needed': 2024}",
        "(4096, 4096)",
    ]


def test_a_limit_with_room_is_left_alone() -> None:
    out = run("print(ensure_fd_room(10, Settings()))", nofile=(2048, 4096))
    assert (out.returncode, out.stdout.strip()) == (0, "{'limit': 2048, 'needed': 1034}")


def test_too_low_a_hard_limit_refuses_to_start_naming_the_fix() -> None:
    out = run("ensure_fd_room(1000, Settings())", nofile=(300, 1024))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "the pools are 1000 chunks of chunk_size 67108864 bytes, one open file each, and with"
        " headroom the daemon needs 2024 open files, but the hard limit (ulimit -Hn) is 1024:"
        " raise it (LimitNOFILE= in the systemd unit), or use a larger chunk_size or smaller"
        " pools"
    )


def test_the_daemon_refuses_to_start_when_its_chunks_cannot_be_open_files() -> None:
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as d:
        out = subprocess.run(
            [
                *(sys.executable, "-m", "tidalpoold", "serve", "--socket-dir", d),
                *("--device-pool", "1GiB", "--host-pool", "1GiB", "--chunk-size", "2MiB"),
                *("--default-device-lease", "64MiB", "--default-host-lease", "64MiB"),
                *("--metrics-address", "", "--plan-cache-dir", d),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512)),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    assert out.returncode == 2  # a setting (the pools, chunk_size) the limit refuses
    assert "the pools are 1024 chunks of chunk_size 2097152 bytes" in out.stderr


def test_the_daemon_is_not_dumpable() -> None:
    out = run("make_undumpable()\nprint(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))")  # GET
    assert (out.returncode, out.stdout.strip()) == (0, "0")
