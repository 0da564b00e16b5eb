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
def short_dir() -> Iterator[Path]:
    """A temporary directory under /tmp, removed at the end of the test."""
    # Unix socket paths are limited to 107 bytes: keep the directory short.
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as directory:
        yield Path(directory)


@pytest.fixture
def daemon(start_daemon: StartDaemon) -> LocalDaemon:
    """One sim daemon with the defaults of `start_daemon`."""
    return start_daemon()


@pytest.fixture(scope="session")
def shapes_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trace of two iteration shapes: a small MLP trained with SGD and momentum, recorded on
    the CPU at batches of 512 and 128 (`tidalpool.torch.record(..., batches=)`)."""
    torch = pytest.importorskip("torch")
    from tidaloffline.torch.record import record

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    )

    def batch(n: int) -> tuple[object, object]:
        return torch.randn(n, 256), torch.randint(0, 10, (n,))

    def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    path = tmp_path_factory.mktemp("shapes") / "mlp.shapes.trace.csv"
    record(
        model, batch(512), torch.nn.functional.cross_entropy, sgd, path=path, batches=[batch(128)]
    )
    return path
