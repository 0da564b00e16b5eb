"""The conformance suite: the same cases against every backend, through the public API.

Each test takes the `backend` fixture ("sim", and "cuda" where a GPU and cuda-bindings are
present; skipped with the reason otherwise) and a real daemon of that backend. What a backend
must provide beyond the public API sits here, in hooks named for what they measure:

  block_bytes(session, block)          the block's bytes as a writable memoryview
  mapped_files(address, length)        (dev, inode, name) of the files mapped in a range
  physical_device_probe(backend)       measures the physical memory behind the device chunks
  host_copy(view), fill(view, values)  a tensor view's values to and from host memory
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tidalpool
from tidalclient import status
from tidalclient.executors.base import Block
from tidalclient.local import LocalDaemon
from tidalcore.cuda_driver import DevicePtr, StreamHandle

from ..conftest import StartDaemon
from ..gpu.conftest import gpu_missing, nvml_used

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


def block_bytes(session: tidalpool.Session, block: Block) -> memoryview | DeviceBytes:
    """The block's bytes, readable and writable from this process (on cuda through copies:
    NumPy and memoryviews cannot reach GPU memory)."""
    if session.cuda is None:
        return session.buffer(block)
    return DeviceBytes(session, session.address(block), block.size)


class DeviceBytes:
    """The bytes of a device range as `bytes(view)`, `view[a:b]` and `view[a:b] = data` do
    them, each a synchronous copy by the session's driver."""

    def __init__(self, session: tidalpool.Session, address: int, length: int) -> None:
        assert session.cuda is not None
        self._driver, self._address, self._length = session.cuda.driver, address, length

    def __len__(self) -> int:
        return self._length

    def __bytes__(self) -> bytes:
        return self[:]

    def __getitem__(self, key: slice) -> bytes:
        start, stop, step = key.indices(self._length)
        assert step == 1
        out = ctypes.create_string_buffer(max(stop - start, 0))
        if stop > start:
            self._driver.memcpy_dtoh(
                ctypes.addressof(out), DevicePtr(self._address + start), stop - start
            )
        return out.raw

    def __setitem__(self, key: slice, data: bytes) -> None:
        start, stop, step = key.indices(self._length)
        assert step == 1 and len(data) == stop - start, (key, len(data))
        src = ctypes.create_string_buffer(bytes(data), len(data))
        self._driver.memcpy_htod(DevicePtr(self._address + start), ctypes.addressof(src), len(data))
        self._driver.stream_synchronize(StreamHandle(0))


def host_copy(view: Any) -> np.ndarray[Any, Any]:
    """A tensor view's values in host memory (on cuda the view is a CuPy array)."""
    return view if isinstance(view, np.ndarray) else view.get()


def fill(view: Any, values: np.ndarray[Any, Any]) -> None:
    """Write host values into a tensor view (on cuda a copy to the device)."""
    if isinstance(view, np.ndarray):
        view[:] = values
    else:
        view.set(values)


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
    cuda: the bytes in use on the daemon's GPU as NVML counts them (total - free): the pool,
    allocated whole at start, plus the CUDA context of every client process on that GPU. A
    client's chunks stay in the pool when it dies; its context is freed with its process.
    """
    if backend == "sim":
        return _memfd_resident_bytes
    if backend == "cuda":
        return _nvml_used_bytes
    return None


def _memfd_resident_bytes(daemon: LocalDaemon) -> int:
    pool, _ = status.fetch(daemon.socket_dir)
    return int(pool.facts["resident_bytes"])


def _nvml_used_bytes(daemon: LocalDaemon) -> int:
    pool, _ = status.fetch(daemon.socket_dir)  # GPU only: cuda is skipped without one
    return nvml_used(pool.facts["pci_bus_id"])
