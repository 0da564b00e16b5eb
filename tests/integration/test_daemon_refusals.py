"""`tidalpoold serve` refusing what its settings ask: one line after "tidalpoold:", exit 2,
whether the value itself is wrong (a negative size) or start-up finds it wrong (a socket or
plan-cache directory that is a file, pools of more chunks than open files allow)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile

import pytest
from tidalclient.status import as_json, fact
from tidalcore.v1 import admin_pb2
from tidalpoold.cli import joined_values


def serve(*args: str, nofile: tuple[int, int] | None = None) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as d:
        return subprocess.run(
            [sys.executable, "-m", "tidalpoold", "serve", "--socket-dir", d, "--device-pool",
             "8MiB", "--host-pool", "8MiB", "--default-device-lease", "2MiB",
             "--default-host-lease", "2MiB", "--chunk-size", "2MiB", "--plan-cache-dir", d,
             "--metrics-address", "", *args],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=None if nofile is None else (
                lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
            ),
        )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ("--device-pool", "-1GiB"),
            "tidalpoold: device_pool: a size must not be negative (got '-1GiB' from --device-pool)",
        ),
        (
            ("--default-host-lease", "-2"),
            "tidalpoold: default_host_lease: a size must not be negative (got '-2' from"
            " --default-host-lease)",
        ),
        (("--gpu", "-1"), "tidalpoold: gpu: must not be negative (got '-1' from --gpu)"),
        (("--socket-dir", "/etc/passwd"), "tidalpoold: socket_dir /etc/passwd is not a directory"),
        (
            ("--socket-dir", "/etc/passwd/tp"),
            "tidalpoold: socket_dir /etc/passwd/tp is under /etc/passwd, which is not a directory",
        ),
        (
            ("--plan-cache-dir", "/etc/passwd"),
            "tidalpoold: plan_cache_dir /etc/passwd is not a directory",
        ),
        (
            ("--plan-cache-dir", "/etc/passwd/plans"),
            "tidalpoold: plan_cache_dir /etc/passwd/plans is under /etc/passwd, which is not a"
            " directory",
        ),
    ],
)
def test_a_setting_refused_exits_2_in_one_prefixed_line(args: tuple[str, ...], line: str) -> None:
    out = serve(*args)
    assert (out.returncode, out.stderr) == (2, line + "\n")


def test_pools_beyond_the_open_files_limit_exit_2_prefixed() -> None:
    out = serve("--device-pool", "1GiB", "--host-pool", "1GiB", nofile=(256, 512))
    assert out.returncode == 2
    assert out.stderr.startswith("tidalpoold: the pools are 1024 chunks of chunk_size 2097152")
    assert out.stderr.count("\n") == 1


def test_only_a_settings_value_that_looks_negative_is_joined() -> None:
    assert joined_values(["serve", "--device-pool", "-1GiB", "--debug", "-5"]) == [
        "serve", "--device-pool=-1GiB", "--debug", "-5",
    ]  # fmt: skip
    assert joined_values(["serve", "--gpu", "--debug"]) == ["serve", "--gpu", "--debug"]


def test_status_json_gives_numeric_facts_as_numbers() -> None:
    pool = admin_pb2.PoolStatusResponse()
    pool.facts.update(
        {"device": "sim (memfd chunks)", "chunk_bytes": "67108864", "h2d_gbps": "11.0",
         "note": "nan", "model": "1_0"}
    )  # fmt: skip
    got = json.loads(as_json(pool, admin_pb2.ListSessionsResponse()))["pool"]["facts"]
    assert got == {
        "device": "sim (memfd chunks)", "chunk_bytes": 67108864, "h2d_gbps": 11.0,
        "note": "nan", "model": "1_0",
    }  # fmt: skip
    assert type(got["chunk_bytes"]) is int and fact("-3") == -3
