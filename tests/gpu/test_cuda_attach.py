"""End to end on a GPU: a real `tidalpoold --backend cuda`, client processes that attach, put
CuPy arrays in their lease through tidalpool.cupy and read them back, and the reclaim of a
SIGKILLed client's lease, seen by the daemon and by NVML."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from tidalclient import status
from tidalclient.local import LocalDaemon

from ..conftest import StartDaemon
from .conftest import nvml_used

MiB = 1 << 20
LEASE = 16 * MiB

# A client process: attaches, computes on CuPy arrays in its lease, prints one JSON line, then
# holds the session until told to quit (or killed).
CLIENT = r"""
import json, sys
import cupy
import tidalpool, tidalpool.cupy as tpc

s = tidalpool.attach(sys.argv[1], device_limit=int(sys.argv[2]), host_limit=int(sys.argv[2]))
tpc.use(s, pinned=False)
cupy.cuda.Device(s.cuda.ordinal).use()
x = cupy.arange(1 << 20, dtype=cupy.float32)
with tpc.op(s, [x], [], name="double") as (xv,):
    y = xv * 2
lo, hi = s.device.address, s.device.address + s.device.length
last, total = float(y[-1]), float(y.sum())
tpc.current().collect()  # frees the blocks of the temporaries CuPy has dropped
print(json.dumps({
    "session": s.id,
    "mode": s.cuda.mode,
    "ordinal": s.cuda.ordinal,
    "bus": s.cuda.pci_bus_id,
    "in_lease": all(lo <= a.data.ptr < hi for a in (x, y)),
    "last": last,
    "sum": total,
    "live_blocks": s.executor.stats().live_blocks,
}), flush=True)
sys.stdin.readline()
del x, y
s.close()
print("closed", flush=True)
"""


def spawn(
    d: LocalDaemon, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict[str, object]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(d.socket_dir), str(LEASE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        pytest.fail(f"the client process exited ({proc.returncode}) before attaching")
    return proc, json.loads(line)


@pytest.fixture(params=["auto", "ipc"])
def cuda_daemon(request: pytest.FixtureRequest, start_daemon: StartDaemon) -> Iterator[LocalDaemon]:
    pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings")
    yield start_daemon("--cuda-mode", request.param, backend="cuda", chunk_size="2MiB")


def kill(d: LocalDaemon, proc: subprocess.Popen[str]) -> None:
    """SIGKILL a client and wait until the daemon has taken its leases back (2 s at most)."""
    proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(timeout=10)
    while time.monotonic() - killed_at < 2.0:
        if status.fetch(d.socket_dir)[0].device.leased_bytes == 0:
            break
        time.sleep(0.01)


def steady_nvml_used(bus: str, still: float = 1.0, seconds: float = 10.0) -> int:
    """NVML's used bytes once they have not moved for `still` seconds (or `seconds` passed)."""
    deadline = time.monotonic() + seconds
    used, since = nvml_used(bus), time.monotonic()
    while time.monotonic() - since < still and time.monotonic() < deadline:
        time.sleep(0.1)
        if (now := nvml_used(bus)) != used:
            used, since = now, time.monotonic()
    return used


def settled_nvml_used(bus: str, target: int, seconds: float = 5.0) -> int:
    """NVML's used bytes once they equal `target` or `seconds` have passed: a dead process's
    memory is freed as the driver tears its context down, not at once."""
    deadline = time.monotonic() + seconds
    while (used := nvml_used(bus)) != target and time.monotonic() < deadline:
        time.sleep(0.05)
    return used


def test_a_client_computes_in_its_lease_and_a_sigkill_gives_it_back(
    cuda_daemon: LocalDaemon,
) -> None:
    d = cuda_daemon
    pool, _ = status.fetch(d.socket_dir)
    bus = pool.facts["pci_bus_id"]
    # The baseline comes after a first client has lived and been killed. NVML counts the whole
    # GPU, the driver's own memory included: on an H200 (driver 580.159.04) it stayed 65,536
    # bytes above its level before the first client, while the daemon makes no CUDA call for a
    # session but the memset that scrubs its chunks on the one stream it made at start. A leak
    # per client would still show here, as the second client's excess.
    used_at_start = steady_nvml_used(bus)
    first, _ = spawn(d)
    try:
        kill(d, first)
    finally:
        first.communicate(timeout=10)
    used_before = steady_nvml_used(bus)
    first_left = used_before - used_at_start  # 65,536 on that H200
    proc, got = spawn(d)
    try:
        assert got["bus"] == bus and got["mode"] == pool.mode
        assert got["in_lease"] is True
        assert got["last"] == 2.0 * ((1 << 20) - 1)
        assert got["sum"] == float((1 << 20) * ((1 << 20) - 1))
        assert got["live_blocks"] == 2  # x and y, nothing through CuPy's own pool
        assert status.fetch(d.socket_dir)[0].device.leased_bytes == LEASE
        assert nvml_used(bus) > used_before  # the client's context; the pool was there before
        kill(d, proc)
        pool, sessions = status.fetch(d.socket_dir)
        assert (pool.device.leased_bytes, pool.host.leased_bytes) == (0, 0)
        assert list(sessions.sessions) == []
        # The client's memory (its context; its chunks stay in the pool, scrubbed) is freed
        # with its process: NVML sees the GPU as before it started.
        used_after = settled_nvml_used(bus, used_before)
        assert used_after == used_before, (
            f"{used_after - used_before} bytes more ({first_left} after the first client)"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)  # waits, and closes the pipes
    # The next client gets zeroed chunks and computes as the first did.
    proc, again = spawn(d)
    try:
        assert again["sum"] == got["sum"] and again["in_lease"] is True
    finally:
        proc.communicate("quit\n", timeout=30)
    assert proc.returncode == 0 and status.fetch(d.socket_dir)[0].device.leased_bytes == 0


def test_the_client_opens_the_daemons_gpu_whatever_cuda_visible_devices_says(
    start_daemon: StartDaemon,
) -> None:
    import pynvml

    pytest.importorskip("cupy")
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    if count < 2:
        pytest.skip(f"needs two GPUs to number them differently (this machine has {count})")
    d = start_daemon("--gpu", "1", backend="cuda", chunk_size="2MiB")
    bus = status.fetch(d.socket_dir)[0].facts["pci_bus_id"]
    proc, got = spawn(d, env={"CUDA_VISIBLE_DEVICES": "1"})  # the daemon's GPU 1 is 0 here
    try:
        assert (got["bus"], got["ordinal"]) == (bus, 0)
        assert got["sum"] == float((1 << 20) * ((1 << 20) - 1))
    finally:
        proc.communicate("quit\n", timeout=30)
    assert proc.returncode == 0


def test_cupy_arrays_keep_their_data_after_the_daemon_dies_and_the_session_closes(
    start_daemon: StartDaemon,
) -> None:
    """The daemon SIGKILLed while a job holds arrays, then the job's session closed: a device
    array and a pinned one read their own data afterwards, never zeros (a checkpoint saved by
    a handler after the crash)."""
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings")
    import tidalpool
    import tidalpool.cupy as tpc

    d = start_daemon("--cuda-mode", "vmm", backend="cuda", chunk_size="2MiB")
    s = tidalpool.attach(d.socket_dir, device_limit=8 << 20, host_limit=8 << 20)
    try:
        tpc.use(s)
        x = cupy.arange(3 << 18, dtype=cupy.float32)  # 3 MiB: over two granules
        pinned = cupy.cuda.alloc_pinned_memory(4096)
        ctypes.memmove(pinned.ptr, b"saved", 5)
        want = float(x.sum())
        d.process.send_signal(signal.SIGKILL)
        d.process.wait(timeout=10)
        s.close()
        assert float(x.get().sum()) == want  # read back as a checkpoint is, allocating nothing
        assert ctypes.string_at(pinned.ptr, 5) == b"saved"
        with pytest.raises(tidalpool.SessionClosed, match="is over"):  # not CuPy's out of memory
            x + 1
    finally:
        tpc.stop()
        s.close()
