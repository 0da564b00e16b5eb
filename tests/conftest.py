"""Shared fixtures: real tidalpoold processes in short temporary socket directories."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tidalclient.local import LocalDaemon

StartDaemon = Callable[..., LocalDaemon]

# The shared data (traces, MiniMalloc instances) sits beside the repository, as in CI.
SHARED = Path(__file__).resolve().parents[2] / "shared"


def shared_file(relative: str) -> Path:
    """A file of ../shared, or skip the test saying which is missing."""
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"shared data {path} is not present beside the repository")
    return path


@pytest.fixture
def start_daemon() -> Iterator[StartDaemon]:
    """Start sim daemons (256 MiB pools of 2 MiB chunks, 64 MiB default leases, extra CLI args
    allowed); every one is stopped and its directory removed at the end of the test."""
    started: list[LocalDaemon] = []

    def start(
        *extra: str,
        device_pool: str = "256MiB",
        host_pool: str = "256MiB",
        chunk_size: str = "2MiB",
        backend: str = "sim",
    ) -> LocalDaemon:
        # Unix socket paths are limited to 107 bytes: keep the directory short.
        directory = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
        d = LocalDaemon.start(
            directory,
            device_pool=device_pool,
            host_pool=host_pool,
            default_lease="64MiB",
            extra=extra,
            backend=backend,
            chunk_size=chunk_size,
        )
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
        shutil.rmtree(d.socket_dir, ignore_errors=True)


@pytest.fixture
def daemon(start_daemon: StartDaemon) -> LocalDaemon:
    """One sim daemon with the defaults of `start_daemon`."""
    return start_daemon()
