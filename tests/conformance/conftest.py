"""The conformance suite: the same cases against every backend, through the public API.

Each test takes the `backend` fixture ("sim", and "cuda" where a GPU and cuda-bindings are
present; skipped with the reason otherwise) and a real daemon of that backend. What a backend
must provide beyond the public API sits here, in hooks named for what they measure:

  block_bytes(session, block)          the block's bytes as a writable memoryview
  mapped_files(address, length)        (dev, inode, name) of the files mapped in a range
  physical_device_probe(backend)       measures the physical memory behind the device chunks
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator

import pytest
import tidalpool
from tidalpool import status
from tidalpool.executor import Block
from tidalpool.local import LocalDaemon

from ..conftest import StartDaemon
from ..gpu.conftest import gpu_missing

BACKENDS = ["sim", "cuda"]
CHUNK = 2 << 20  # the suite's chunk size: small leases still span several chunks


def cuda_missing() -> str | None:
    """Why the cuda backend cannot run here, or None."""
    why = gpu_missing()
    if why is not None:
        return why
    if importlib.util.find_spec("cuda") is None or not importlib.util.find_spec("cuda.bindings"):
        return "cuda-bindings is not installed (pip install '.[cuda]')"
    if importlib.util.find_spec("tidalpoold.backends.cuda") is None:
        return "the daemon has no cuda backend module"
    return None


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name == "cuda":
        why = cuda_missing()
        if why is not None:
            pytest.skip(why)
    return name


@pytest.fixture
def pool_daemon(backend: str, start_daemon: StartDaemon) -> Iterator[LocalDaemon]:
    """A daemon of `backend`: 256 MiB pools of 2 MiB chunks, 64 MiB default leases."""
    yield start_daemon(backend=backend, chunk_size=f"{CHUNK}B")


# -- hooks -----------------------------------------------------------------------------------------


def block_bytes(session: tidalpool.Session, block: Block) -> memoryview:
    """The block's bytes, readable and writable from this process."""
    return session.buffer(block)


def mapped_files(address: int, length: int) -> list[tuple[int, int, str]]:
    """(dev, inode, name) of each file mapping in [address, address + length) of this process,
    in address order (anonymous mappings are left out). On cuda, device memory is not a file
    mapping of the process: only host leases show here."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inode = int(fields[4])
            if inode and start < address + length and end > address:
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                name = fields[5].strip() if len(fields) > 5 else ""
                found.append((os.makedev(major, minor), inode, name))
    return found


def physical_device_probe(backend: str) -> Callable[[LocalDaemon], int] | None:
    """How to measure the bytes of physical memory behind a daemon's device chunks, or None.

    sim: the pages of its device memfds (`resident_bytes` among the daemon's facts).
    cuda: None until the GPU tests supply an NVML probe; tests then skip that check, saying so.
    """
    if backend == "sim":
        return _memfd_resident_bytes
    return None


def _memfd_resident_bytes(daemon: LocalDaemon) -> int:
    pool, _ = status.fetch(daemon.socket_dir)
    return int(pool.facts["resident_bytes"])
